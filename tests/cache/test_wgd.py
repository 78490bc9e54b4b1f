"""WindowedGreedyDualPolicy: window, scan-resistant probation, ghosts and GreedyDual ageing."""

from __future__ import annotations

import math

import pytest
from cache_helpers import ManualClock, cache_sequence, tokens

from radixserve.cache import RadixCache, TokenToKVPoolAllocator
from radixserve.cache.evict import WindowedGreedyDualPolicy, prefix_identity
from radixserve.errors import InvalidArgumentError


def make(pool: int = 100, **kwargs) -> tuple[RadixCache, ManualClock]:
    clock = ManualClock()
    policy = WindowedGreedyDualPolicy(**kwargs)
    cache = RadixCache(TokenToKVPoolAllocator(pool), eviction_policy=policy, clock=clock)
    return cache, clock


def seq(i: int, n: int = 8) -> list[int]:
    return [1000 * i + k for k in range(n)]


def cached(cache: RadixCache, i: int, n: int = 8) -> bool:
    return cache.peek_prefix(tokens(seq(i, n))) == n


def admit(cache: RadixCache, clock: ManualClock, i: int, n: int = 8) -> None:
    """What the scheduler does for a prompt: make room, match, insert."""
    clock.advance()
    short = n - cache.allocator.available_size()
    if short > 0:
        cache.evict(short)
    cache.match_prefix(tokens(seq(i, n)))
    cache_sequence(cache, seq(i, n))
    cache.check_invariants()


def test_a_stream_of_one_off_prompts_does_not_flush_the_residents():
    cache, clock = make(pool=100)
    for i in range(10):  # fill the pool: 80 tokens of residents
        admit(cache, clock, i)
    for i in range(100, 130):  # a scan three times the cache, never reused
        admit(cache, clock, i)
    residents = sum(cached(cache, i) for i in range(10))
    assert residents >= 8, "the scan went through the window and probation's newest end"


def test_lru_loses_the_residents_to_the_same_scan():
    clock = ManualClock()
    cache = RadixCache(TokenToKVPoolAllocator(100), eviction_policy="lru", clock=clock)
    for i in [*range(10), *range(100, 130)]:
        admit(cache, clock, i)
    assert not any(cached(cache, i) for i in range(10))


def test_the_newest_leaves_sit_in_the_window_and_outlast_probation():
    cache, clock = make(pool=100, window=0.3)  # 30 tokens: the last three 8-token prompts
    for i in range(8):
        admit(cache, clock, i)
    policy = cache.policy
    assert [policy.segment(n) for n in _leaves(cache, range(8))] == ["probation"] * 5 + [
        "window"
    ] * 3
    cache.evict(5 * 8)
    assert [cached(cache, i) for i in range(8)] == [False] * 5 + [True] * 3


def test_probation_evicts_the_newest_demotion_first():
    cache, clock = make(pool=100, window=0.05)  # 5 tokens: every prompt is demoted at once
    for i in range(6):
        admit(cache, clock, i)
    cache.evict(8)
    assert [cached(cache, i) for i in range(6)] == [True] * 5 + [False]


def test_a_hit_protects_a_node_over_probation():
    cache, clock = make(pool=100, window=0.05)
    for i in range(6):
        admit(cache, clock, i)
    clock.advance()
    cache.match_prefix(tokens(seq(5)))  # the newest demotion, now hit
    cache.evict(8)
    assert cached(cache, 5) and not cached(cache, 4)


def test_a_ghost_hit_reinserts_a_node_as_protected():
    cache, clock = make(pool=100, window=0.05)
    for i in range(3):
        admit(cache, clock, i)
    (node,) = _leaves(cache, [2])
    identity = prefix_identity(node, 4)
    cache.evict(8)  # the newest demotion: seq 2, never hit
    assert not cached(cache, 2) and identity in cache.policy._ghosts
    admit(cache, clock, 2)
    (again,) = _leaves(cache, [2])
    assert cache.policy.segment(again) == "protected" and again.hit_count == 0
    assert identity not in cache.policy._ghosts
    cache.evict(8)
    assert cached(cache, 2), "probation went first"


def test_ghosts_are_bounded_by_tokens():
    cache, clock = make(pool=100, window=0.05, ghost=0.2)  # 20 tokens of ghosts
    for i in range(40):
        admit(cache, clock, i)
    policy = cache.policy
    assert policy._ghost_tokens == sum(policy._ghosts.values()) <= 20
    assert len(policy._ghosts) == 2


def test_prefix_identity_names_the_place_not_the_node():
    cache, _ = make(pool=100)
    cache_sequence(cache, [1, 2, 3, 4])
    cache_sequence(cache, [1, 2, 3, 9])  # splits [1,2,3,4] into [1,2,3] + [4]
    leaf = cache.match_prefix(tokens([1, 2, 3, 4])).last_node
    other = RadixCache(TokenToKVPoolAllocator(100), clock=ManualClock())
    cache_sequence(other, [1, 2, 3, 4, 5])
    cache_sequence(other, [1, 2, 3, 7])
    twin = other.match_prefix(tokens([1, 2, 3, 4, 5])).last_node
    assert prefix_identity(leaf, 4) == prefix_identity(twin, 4), "same tokens above, same page"
    sibling = cache.match_prefix(tokens([1, 2, 3, 9])).last_node
    assert prefix_identity(leaf, 4) != prefix_identity(sibling, 4)
    in_namespace = RadixCache(TokenToKVPoolAllocator(100), clock=ManualClock())
    cache_sequence(in_namespace, [1, 2, 3, 4, 5], extra_key="lora")
    cache_sequence(in_namespace, [1, 2, 3, 7], extra_key="lora")
    ns_twin = in_namespace.match_prefix(tokens([1, 2, 3, 4, 5]), "lora").last_node
    assert prefix_identity(ns_twin, 4) != prefix_identity(twin, 4)


def test_greedy_dual_ages_out_hits_that_are_old():
    cache, clock = make(pool=200, window=0.01)
    for i in range(6):
        admit(cache, clock, i)
    clock.now = 10
    for i, hits in ((0, 3), (1, 3), (2, 1)):  # H = log2(2 + hits): 2.32, 2.32, 1.58
        for _ in range(hits):
            cache.match_prefix(tokens(seq(i)))
    cache.evict(3 * 8)  # probation (3, 4, 5; H = 0) first, and L stays 0
    assert [cached(cache, i) for i in range(6)] == [True] * 3 + [False] * 3
    clock.now = 11
    cache.evict(8)  # seq 2 (H = 1.58): L rises to 1.58
    assert cache.policy.level_at(11.5) == pytest.approx(math.log2(3))
    clock.now = 12
    cache_sequence(cache, seq(3))  # back after a ghost: protected; then one hit
    cache.match_prefix(tokens(seq(3)))
    (fresh,) = _leaves(cache, [3])
    assert cache.policy.key(fresh)[0] == pytest.approx(2 * math.log2(3)), "H = L + log2(3)"
    cache.evict(2 * 8)
    assert cached(cache, 3), "one recent hit outranks three old ones once L has risen"
    assert not cached(cache, 0) and not cached(cache, 1)
    cache.check_invariants()


def test_level_at_counts_only_evictions_strictly_before():
    policy = WindowedGreedyDualPolicy()
    policy.on_evict(_Bare(), (3.0, 1, 0.0), now=5.0)
    policy.on_evict(_Bare(), (4.0, 1, 0.0), now=5.0)
    policy.on_evict(_Bare(), (2.0, 1, 0.0), now=6.0)  # lower than L: no change
    assert (policy.level_at(5.0), policy.level_at(5.5), policy.level_at(7.0)) == (0.0, 4.0, 4.0)


def test_the_level_history_stays_bounded_and_keys_survive_compaction():
    cache, clock = make(pool=100, window=0.01)
    policy = cache.policy
    for i in range(5):
        admit(cache, clock, i)
    longest = 0
    for k in range(3000):  # evictions elsewhere raising L, each at its own time
        clock.now = 10.0 + k
        if k % 400 == 0:
            for i in range(5):  # the tree's nodes get used now and then
                cache.match_prefix(tokens(seq(i)))
            before = {node: policy.key(node) for node in cache._nodes()}
        policy.on_evict(_Bare(), (float(k + 1), 1, 0.0), now=clock.now)
        longest = max(longest, len(policy._levels))
        assert {node: policy.key(node) for node in cache._nodes()} == before, "no key changed"
    assert longest <= 1025, "cut back as it doubled past the node count"
    assert policy.level_at(math.inf) == 3000.0
    cache.check_invariants()


def test_reset_starts_the_policy_afresh():
    cache, clock = make(pool=100, window=0.05)
    for i in range(20):
        admit(cache, clock, i)
    cache.reset()
    policy = cache.policy
    assert (policy._window_tokens, len(policy._window), len(policy._ghosts)) == (0, 0, 0)
    admit(cache, clock, 1)
    cache.check_invariants()


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"window": 1}, {"ghost": -1}])
def test_arguments_are_validated(kwargs):
    with pytest.raises(InvalidArgumentError):
        WindowedGreedyDualPolicy(**kwargs)


class _Bare:
    eviction_state = None
    hit_count = 1


def _leaves(cache: RadixCache, indices) -> list:
    return [cache.match_prefix(tokens(seq(i)), count_hit=False).last_node for i in indices]
