"""learned-lru: LRU with a tolerated age per hit class, learned from reuse times and ghosts."""

from __future__ import annotations

import numpy as np
import pytest
from cache_helpers import (
    ManualClock,
    cache_sequence,
    chat_sessions,
    hot_and_scan,
    serve_random_prompt,
    tokens,
)

from radixserve.cache import RadixCache, TokenToKVPoolAllocator
from radixserve.cache.learned import LearnedLRUPolicy, _bin
from radixserve.errors import InvalidArgumentError
from radixserve.sim.cacheonly import simulate_cache


def test_one_class_is_exactly_lru():
    trace = chat_sessions()
    lru = simulate_cache(trace, "lru", kv_tokens=6_000)
    policy = LearnedLRUPolicy(classes=1)
    one = simulate_cache(trace, policy, kv_tokens=6_000, check_invariants=True)
    assert one.hit_tokens == lru.hit_tokens and one.evicted_tokens == lru.evicted_tokens
    assert policy.eviction_age is not None, "it did evict, and learned"


def test_it_keeps_what_comes_back_and_beats_lru_when_frequency_pays():
    trace = hot_and_scan()
    lru = simulate_cache(trace, "lru", kv_tokens=2_000).hit_rate
    policy = LearnedLRUPolicy()
    learned = simulate_cache(trace, policy, kv_tokens=2_000, check_invariants=True).hit_rate
    assert learned > lru + 0.05
    never_hit, *hit = policy.tolerance
    assert all(t > never_hit for t in hit), "reused prefixes are tolerated longer"


def test_it_stays_near_lru_when_recency_pays():
    trace = chat_sessions()
    lru = simulate_cache(trace, "lru", kv_tokens=6_000).hit_rate
    learned = simulate_cache(trace, LearnedLRUPolicy(), kv_tokens=6_000).hit_rate
    assert learned >= lru - 0.01


def test_it_starts_as_lru_and_a_ghost_reports_a_late_reuse():
    clock = ManualClock()
    policy = LearnedLRUPolicy(epoch=1)
    cache = RadixCache(TokenToKVPoolAllocator(40), eviction_policy=policy, clock=clock)
    assert policy.tolerance == [0.0] * 4
    cache_sequence(cache, list(range(30)))
    clock.advance(5)
    cache_sequence(cache, list(range(100, 130)))  # evicts the first: a ghost
    assert policy.eviction_age == 5 and policy._ghost_tokens == 30
    clock.advance(7)
    cache_sequence(cache, list(range(30)))  # back where the ghost was, 12 after its last use
    assert policy._reused[0][_bin(12.0)] == 30 and policy._ghost_tokens == 30
    cache.check_invariants()


def test_references_record_reuse_ages_by_hit_class():
    clock = ManualClock()
    policy = LearnedLRUPolicy()
    cache = RadixCache(TokenToKVPoolAllocator(1_000), eviction_policy=policy, clock=clock)
    cache_sequence(cache, list(range(20)))
    clock.advance(3)
    cache.match_prefix(tokens(range(20)))  # a hit: the node moves to class 1
    cache_sequence(cache, list(range(20)))
    clock.advance(4)
    cache.match_prefix(tokens(range(20)))
    cache_sequence(cache, list(range(20)))
    assert policy._reused[0][_bin(3.0)] == 20  # reused 3 after its insertion, while never hit
    assert policy._reused[1][_bin(4.0)] == 20  # then 4 later, as a once-hit node


def test_tolerance_changes_keep_every_invariant():
    policy = LearnedLRUPolicy(epoch=5)
    cache = RadixCache(TokenToKVPoolAllocator(150), eviction_policy=policy)
    rng = np.random.default_rng(1)
    changes = 0
    for i in range(1_400):
        before = list(policy.tolerance)
        serve_random_prompt(cache, rng, i)
        changes += policy.tolerance != before
    assert changes >= 3, "the tolerances moved, and every key followed"


def test_bad_arguments_are_refused():
    for kwargs in (dict(classes=0), dict(ghost=-1), dict(horizon=1), dict(epoch=0)):
        with pytest.raises(InvalidArgumentError):
            LearnedLRUPolicy(**kwargs)


def test_it_is_selectable_by_name():
    cache = RadixCache(TokenToKVPoolAllocator(64), eviction_policy="learned-lru")
    assert isinstance(cache.policy, LearnedLRUPolicy)
