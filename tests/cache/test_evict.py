"""Eviction policies: each evicts in the order its key defines, and users can add their own."""

from __future__ import annotations

import pytest
from cache_helpers import ManualClock, cache_sequence

from radixserve.cache import (
    RadixCache,
    TokenToKVPoolAllocator,
    available_eviction_policies,
    make_eviction_policy,
    register_eviction_policy,
)
from radixserve.cache.evict import _REGISTRY
from radixserve.errors import InvalidArgumentError

# Five disjoint two-token sequences, cached at times 1..5 with the priorities below; then "a"
# is matched three times at time 10, "c" twice at 10.5 and "e" once at 11.
SEQS = {"a": [1, 1], "b": [2, 2], "c": [3, 3], "d": [4, 4], "e": [5, 5]}
PRIORITY = {"a": 3, "b": 1, "c": 2, "d": 0, "e": 5}


def crafted_cache(policy: str) -> RadixCache:
    clock = ManualClock()
    cache = RadixCache(TokenToKVPoolAllocator(64), eviction_policy=policy, clock=clock)
    for name, seq in SEQS.items():
        clock.advance()
        cache_sequence(cache, seq, priority=PRIORITY[name])
    for now, name, times in ((10, "a", 3), (10.5, "c", 2), (11, "e", 1)):
        clock.now = now
        for _ in range(times):
            cache.match_prefix(SEQS[name])
    return cache


def eviction_order(cache: RadixCache) -> list[str]:
    order = []
    while cache.total_size():
        before = {n for n, s in SEQS.items() if cache.peek_prefix(s)}
        assert cache.evict(1) == 2
        cache.check_invariants()
        (gone,) = before - {n for n, s in SEQS.items() if cache.peek_prefix(s)}
        order.append(gone)
    return order


EXPECTED = {
    # last_access_time: b=2 d=4 a=10 c=10.5 e=11
    "lru": ["b", "d", "a", "c", "e"],
    # (hit_count, last_access_time): b=(0,2) d=(0,4) e=(1,11) c=(2,10.5) a=(3,10)
    "lfu": ["b", "d", "e", "c", "a"],
    "fifo": ["a", "b", "c", "d", "e"],
    "mru": ["e", "c", "a", "d", "b"],
    "filo": ["e", "d", "c", "b", "a"],
    # (priority, last_access_time): d=0 b=1 c=2 a=3 e=5
    "priority": ["d", "b", "c", "a", "e"],
    # probationary (hit_count < 2) by LRU: b, d, e; then the protected a, c by LRU
    "slru": ["b", "d", "e", "a", "c"],
    # The window holds 6.4 of the 64 tokens, so a and b were demoted to probation as d and e
    # came in; a's hits protect it. Probation: b (H = 0). Then H = log2(2 + hits) for the
    # window and the hit nodes: d=1, e=1.58, c=2, a=2.32.
    "wgd": ["b", "d", "e", "c", "a"],
}


@pytest.mark.parametrize("policy", sorted(EXPECTED))
def test_policy_evicts_in_key_order(policy):
    assert eviction_order(crafted_cache(policy)) == EXPECTED[policy]


def test_every_builtin_policy_is_registered():
    assert set(EXPECTED) <= set(available_eviction_policies())


def test_a_parent_competes_with_its_own_key_once_it_is_a_leaf():
    clock = ManualClock()
    cache = RadixCache(TokenToKVPoolAllocator(64), eviction_policy="lru", clock=clock)
    clock.now = 1
    cache_sequence(cache, [1, 1, 1, 1])
    clock.now = 2
    cache_sequence(cache, [1, 1, 2, 2])  # splits [1,1]; the parent's access time becomes 2
    clock.now = 3
    cache_sequence(cache, [9, 9])
    clock.now = 4
    cache.match_prefix([1, 1, 2, 2])  # parent [1,1] and leaf [2,2] at 4; leaf [1,1] tail at 2
    assert cache.evict(1) == 2 and cache.peek_prefix([1, 1, 1, 1]) == 2
    assert cache.evict(1) == 2 and cache.peek_prefix([9, 9]) == 0
    assert cache.evict(1) == 2 and cache.peek_prefix([1, 1, 2, 2]) == 2
    assert cache.evict(1) == 2 and cache.total_size() == 0
    cache.check_invariants()


def test_slru_threshold_is_configurable_and_validated():
    policy = make_eviction_policy("slru")
    assert policy.threshold == 2
    with pytest.raises(InvalidArgumentError):
        type(policy)(threshold=0)


def test_user_policy_by_registration_and_by_instance():
    class LongestFirst:
        """Evicts the longest leaf first."""

        name = "longest"
        tracks_access = False

        def key(self, node):
            return -len(node)

    register_eviction_policy("longest", LongestFirst)
    try:
        with pytest.raises(InvalidArgumentError, match="already registered"):
            register_eviction_policy("longest", LongestFirst)
        for chosen in ("longest", LongestFirst()):
            cache = RadixCache(TokenToKVPoolAllocator(64), eviction_policy=chosen)
            cache_sequence(cache, [1, 2])
            cache_sequence(cache, [3, 4, 5, 6])
            assert cache.evict(1) == 4
            assert cache.peek_prefix([1, 2]) == 2
            cache.check_invariants()
    finally:
        _REGISTRY.pop("longest", None)


def test_objects_missing_the_protocol_are_refused():
    with pytest.raises(InvalidArgumentError, match="key"):
        make_eviction_policy(object())


def test_split_rekeys_the_lower_part_for_policies_that_read_length():
    class LongestFirst:
        name = "longest-split"
        tracks_access = False

        def key(self, node):
            return -len(node)

    cache = RadixCache(TokenToKVPoolAllocator(64), eviction_policy=LongestFirst())
    cache_sequence(cache, [1, 2, 3, 4, 5, 6])
    cache_sequence(cache, [9, 9, 9])
    cache.match_prefix([1, 2, 7])  # the 6-token leaf becomes a 2-token node over a 4-token leaf
    cache.check_invariants()
    assert cache.evict(1) == 4 and cache.peek_prefix([9, 9, 9]) == 3


def test_refresh_eviction_key_follows_outside_state():
    order = {"a": 1, "b": 2}

    class External:
        name = "external"
        tracks_access = False

        def key(self, node):
            return order["a" if node.token_ids[0] == 1 else "b"]

    cache = RadixCache(TokenToKVPoolAllocator(64), eviction_policy=External())
    cache_sequence(cache, [1, 1])
    cache_sequence(cache, [2, 2])
    order["a"] = 3
    with pytest.raises(Exception, match="heap key"):
        cache.check_invariants()
    cache.refresh_eviction_key(cache.match_prefix([1, 1]).last_node)
    cache.check_invariants()
    assert cache.evict(1) == 2 and cache.peek_prefix([1, 1]) == 2
