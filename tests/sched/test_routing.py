"""Routing policies: plain decisions on loads, prefixes and the KV events of real trees."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.cache import RadixCache, TokenToKVPoolAllocator
from radixserve.cache.events import AllBlocksCleared
from radixserve.errors import InvalidArgumentError
from radixserve.sched.routing import (
    ROUTING_POLICIES,
    ReplicaLoad,
    RouteRequest,
    make_routing_policy,
)

IDLE = ReplicaLoad()


def loads(*queued_tokens, running=0, waits=None):
    waits = waits or [0.0] * len(queued_tokens)
    return [
        ReplicaLoad(1 if q else 0, q, running, w) for q, w in zip(queued_tokens, waits, strict=True)
    ]


def prompt(*parts, n=32):
    return RouteRequest(np.concatenate([np.full(n, p, dtype=np.int32) for p in parts]))


def test_round_robin_takes_turns():
    policy = make_routing_policy("round_robin", 3)
    assert [policy.choose(prompt(1), [IDLE] * 3) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_pow2_picks_the_less_loaded_of_two():
    policy = make_routing_policy("pow2", 2, seed=3)
    busy = [ReplicaLoad(5, 500, 4), IDLE]
    assert all(policy.choose(prompt(1), busy) == 1 for _ in range(20))
    assert make_routing_policy("pow2", 1).choose(prompt(1), [IDLE]) == 0


def test_cache_aware_follows_prefixes_until_the_load_is_imbalanced():
    policy = make_routing_policy("cache_aware", 3, balance_abs_threshold=4)
    first = policy.choose(prompt(1, 2), [IDLE] * 3)
    other = policy.choose(prompt(7, 8), [IDLE] * 3)
    assert other != first  # no match: the smallest tree
    assert policy.choose(prompt(1, 2, 3), [IDLE] * 3) == first
    skewed = [IDLE] * 3
    skewed[first] = ReplicaLoad(10, 100, 0)
    assert policy.choose(prompt(1, 2, 3), skewed) != first


def test_cache_aware_forgets_a_restarted_replica():
    policy = make_routing_policy("cache_aware", 2)
    home = policy.choose(prompt(1, 2), [IDLE] * 2)
    policy.choose(prompt(7, 8), [IDLE] * 2)  # the other replica's tree is no longer empty
    assert policy.choose(prompt(1, 2, 3), [IDLE] * 2) == home
    policy.forget(home)  # it restarted with an empty cache: nothing draws the prefix there
    assert policy.choose(prompt(1, 2, 3), [IDLE] * 2) == home  # the smallest tree now
    assert policy.choose(prompt(7, 8, 9), [IDLE] * 2) == 1 - home


def _tree_events(cache: RadixCache):
    return cache.take_events()


def test_precise_routes_by_what_the_trees_hold():
    trees = [RadixCache(TokenToKVPoolAllocator(1000), enable_kv_events=True) for _ in range(2)]
    policy = make_routing_policy("precise", 2)
    shared = np.arange(100, 300, dtype=np.int32)
    slots = trees[1].allocator.alloc(len(shared))
    trees[1].insert(shared, slots)
    for k, tree in enumerate(trees):
        policy.on_events(k, tree.take_events())
    request = RouteRequest(np.concatenate([shared, np.array([7, 8, 9], dtype=np.int32)]))
    assert policy.cached_tokens(request) == [0, 200]
    assert policy.choose(request, [IDLE, ReplicaLoad(1, 50, 1)]) == 1
    assert policy.choose(request, [IDLE, ReplicaLoad(9, 5000, 8)]) == 0  # load wins
    assert policy.choose(request, [IDLE, ReplicaLoad(1, 10, 0, oldest_wait=1.0)]) == 0  # aging
    trees[1].evict(150)
    policy.on_events(1, trees[1].take_events())
    assert policy.cached_tokens(request)[1] < 200
    trees[1].reset()
    policy.on_events(1, trees[1].take_events())
    assert policy.cached_tokens(request)[1] == 0


def test_precise_keeps_a_burst_together_before_any_event_confirms_it():
    """Events come only after a prefill; until then the routed pages count as expected."""
    policy = make_routing_policy("precise", 2)
    shared = np.arange(500, 900, dtype=np.int32)
    burst = [RouteRequest(np.append(shared, np.int32(k))) for k in range(4)]
    first = policy.choose(burst[0], [IDLE, IDLE])
    for request in burst[1:]:
        loads = [IDLE, IDLE]
        loads[first] = ReplicaLoad(1, 401, 1)  # the first is queued there
        assert policy.choose(request, loads) == first
    policy.on_events(first, [AllBlocksCleared()])  # what was expected is gone
    assert policy.cached_tokens(burst[0]) == [0, 0]


def test_precise_forgets_a_replica():
    tree = RadixCache(TokenToKVPoolAllocator(100), enable_kv_events=True)
    tree.insert(np.arange(10, dtype=np.int32), tree.allocator.alloc(10))
    policy = make_routing_policy("precise", 2)
    policy.on_events(0, tree.take_events())
    request = RouteRequest(np.arange(10, dtype=np.int32))
    assert policy.cached_tokens(request)[0] == 10
    policy.forget(0)
    assert policy.cached_tokens(request) == [0, 0]


@pytest.mark.parametrize("name", sorted(ROUTING_POLICIES))
def test_sessions_stick_unless_their_replica_is_overloaded(name):
    policy = make_routing_policy(name, 4)
    session = RouteRequest(np.arange(8, dtype=np.int32), session="alice")
    home = policy.choose(session, [IDLE] * 4)
    for _ in range(5):
        assert policy.choose(session, [IDLE] * 4) == home
    crowded = [IDLE] * 4
    crowded[home] = ReplicaLoad(20, 2000, 20)
    assert policy.choose(session, crowded) != home


def test_bad_names_and_counts_are_refused():
    with pytest.raises(InvalidArgumentError, match="router must be one of"):
        make_routing_policy("sticky", 2)
    with pytest.raises(InvalidArgumentError, match="replicas"):
        make_routing_policy("pow2", 0)
    with pytest.raises(InvalidArgumentError, match="expected 2"):
        make_routing_policy("pow2", 2).choose(prompt(1), [IDLE])
