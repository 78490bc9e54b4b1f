"""The adaptive policy and its shadows: sampled estimates, switching, and the tree's invariants."""

from __future__ import annotations

import random

import numpy as np
import pytest
from cache_helpers import (
    ManualClock,
    cache_sequence,
    chat_sessions,
    hot_and_scan,
    tokens,
)

from radixserve.cache import RadixCache, TokenToKVPoolAllocator
from radixserve.cache.adaptive import AdaptivePolicy, _seed
from radixserve.cache.shadow import GreedyDualShadow, LFUShadow, LRUShadow, PrefixHasher
from radixserve.errors import InvalidArgumentError
from radixserve.sim.cacheonly import simulate_cache

# -- prefix hashes ------------------------------------------------------------------------------


def _bytes(values) -> bytes:
    return np.asarray(values, dtype=np.int32).tobytes()


def test_a_prefix_hash_does_not_depend_on_where_edges_are_cut():
    hasher = PrefixHasher(page_size=1, rate=1.0)
    seq = list(range(100, 140))
    whole = hasher.page_hashes(7, _bytes(seq))
    first = hasher.page_hashes(7, _bytes(seq[:13]))
    rest = hasher.page_hashes(int(first[-1]), _bytes(seq[13:]))
    assert list(whole) == [*first, *rest]
    other = hasher.page_hashes(7, _bytes([*seq[:20], 999, *seq[21:]]))
    assert list(other[:20]) == list(whole[:20])
    assert not set(other[20:].tolist()) & set(whole[20:].tolist()), "a changed token renames"
    assert hasher.page_hashes(8, _bytes(seq))[0] != whole[0], "the namespace seed counts"


def test_pages_are_named_at_their_ends_and_sampled_at_the_rate():
    paged = PrefixHasher(page_size=4, rate=1.0)
    seq = list(range(40))
    assert list(paged.page_hashes(3, _bytes(seq))) == list(
        PrefixHasher(1, 1.0).page_hashes(3, _bytes(seq))[3::4]
    )
    sparse = PrefixHasher(page_size=1, rate=0.1)
    seq = np.random.default_rng(0).integers(0, 32_000, 20_000)
    _, _, sampled = sparse.end_and_samples(11, _bytes(seq))
    assert 1_700 < len(sampled) < 2_300


# -- shadows ------------------------------------------------------------------------------------


def _reference_lfu_hits(seq, capacity) -> int:
    """LFU by a full scan: evict the lowest (hits, last use)."""
    state: dict[int, tuple[int, int]] = {}
    hits = 0
    for t, page in enumerate(seq):
        if page in state:
            hits += 1
            state[page] = (state[page][0] + 1, t)
            continue
        if len(state) >= capacity:
            del state[min(state, key=state.__getitem__)]
        state[page] = (0, t)
    return hits


def _reference_lru_hits(seq, capacity) -> int:
    order: list[int] = []
    hits = 0
    for page in seq:
        if page in order:
            hits += 1
            order.remove(page)
        elif len(order) >= capacity:
            order.pop(0)
        order.append(page)
    return hits


@pytest.mark.parametrize("seed", range(3))
def test_lru_and_lfu_shadows_match_plain_implementations(seed):
    rng = random.Random(seed)
    seq = [rng.choice(range(rng.choice([20, 60]))) for _ in range(3_000)]
    lru, lfu = LRUShadow(25), LFUShadow(25)
    assert sum(lru.access(p) for p in seq) == _reference_lru_hits(seq, 25)
    assert sum(lfu.access(p) for p in seq) == _reference_lfu_hits(seq, 25)
    assert len(lru) == len(lfu) == 25


def test_a_request_does_not_evict_its_own_pages():
    for shadow in (LRUShadow(4), LFUShadow(4), GreedyDualShadow(4, 0.25, 1.0)):
        assert shadow.reference([3, 2, 1]) == 0
        assert shadow.reference([6, 5, 2, 1]) == 2, "1 and 2 are renewed before 5 and 6 enter"
        assert shadow.reference([2, 1]) == 2
        assert len(shadow) == 4


def test_the_greedy_dual_shadow_resists_a_scan_that_flushes_lru():
    lru, gd = LRUShadow(50), GreedyDualShadow(50, 0.1, 2.0)
    hot = list(range(30))
    for _ in range(3):
        for page in hot:
            lru.access(page)
            gd.access(page)
    for page in range(1_000, 1_400):  # a scan of one-off pages, eight times the cache
        lru.access(page)
        gd.access(page)
    assert sum(lru.access(p) for p in hot) == 0
    assert sum(gd.access(p) for p in hot) == len(hot)


# -- the policy in a tree -----------------------------------------------------------------------


def test_the_lru_shadow_predicts_the_tree_under_lru():
    policy = AdaptivePolicy(sample_pages=100_000, margin=0.99)  # samples all, never switches
    simulate_cache(chat_sessions(), policy, kv_tokens=6_000)
    assert policy.mode == "lru" and not policy.switches
    counted = [(real, raw["lru"]) for _, _, real, raw in policy.decisions[2:]]
    real = sum(r for r, _ in counted) / len(counted)
    shadow = sum(s for _, s in counted) / len(counted)
    assert len(counted) >= 5 and abs(real - shadow) < 0.02


def test_it_leaves_lru_when_frequency_pays_and_beats_lru():
    trace = hot_and_scan()
    lru = simulate_cache(trace, "lru", kv_tokens=2_000).hit_rate
    lfu = simulate_cache(trace, "lfu", kv_tokens=2_000).hit_rate
    policy = AdaptivePolicy()
    adaptive = simulate_cache(trace, policy, kv_tokens=2_000, check_invariants=True).hit_rate
    assert lfu > lru + 0.05, "the workload is one where frequency pays"
    assert policy.switches and policy.mode != "lru"
    assert adaptive > lru + 0.05, "most of frequency's gain, less the time it took to see it"


def test_it_stays_with_lru_when_recency_pays():
    trace = chat_sessions()
    lru = simulate_cache(trace, "lru", kv_tokens=6_000).hit_rate
    lfu = simulate_cache(trace, "lfu", kv_tokens=6_000).hit_rate
    policy = AdaptivePolicy()
    adaptive = simulate_cache(trace, policy, kv_tokens=6_000).hit_rate
    assert lru > lfu
    assert adaptive >= lru - 0.01


def test_switches_keep_every_invariant():
    policy = AdaptivePolicy(sample_pages=64, margin=0.99, epoch=40)  # switches only by hand
    cache = RadixCache(TokenToKVPoolAllocator(150), eviction_policy=policy)
    rng = np.random.default_rng(1)
    order = ["wgd", "lfu", "lru", "wgd", "lru", "lfu", "wgd"]
    for i in range(1_400):
        if i % 200 == 199:
            policy.follow(order[i // 200])
        base = [7, 7, 7] if rng.random() < 0.5 else [int(rng.integers(1, 50))]
        prompt = [*base, *rng.integers(0, 40, int(rng.integers(1, 12))), i % 7]
        short = len(prompt) - cache.allocator.available_size()
        if short > 0:
            cache.evict(short)
        cache.match_prefix(tokens(prompt))
        cache_sequence(cache, prompt)
        cache.check_invariants()
    assert [mode for _, mode in policy.switches] == order
    with pytest.raises(InvalidArgumentError):
        policy.follow("mru")


def test_a_split_node_is_renamed_consistently():
    clock = ManualClock()
    policy = AdaptivePolicy(sample_pages=10_000)
    cache = RadixCache(TokenToKVPoolAllocator(1_000), eviction_policy=policy, clock=clock)
    cache_sequence(cache, list(range(50)))
    cache_sequence(cache, [*range(20), *range(500, 530)])  # splits the first edge at 20
    upper = cache.match_prefix(tokens(range(20))).last_node
    lower = next(iter(upper.children.values()))
    whole = policy._hasher.page_hashes(_seed(None), _bytes(range(50)))
    assert policy._record(upper)[1] == int(whole[19])
    assert policy._record(lower)[1] == int(whole[49])
    cache.check_invariants()


def test_bad_arguments_are_refused():
    for kwargs in (dict(sample_pages=8), dict(margin=1.0), dict(epoch=0), dict(window=0)):
        with pytest.raises(InvalidArgumentError):
            AdaptivePolicy(**kwargs)


def test_it_is_selectable_by_name_everywhere():
    cache = RadixCache(TokenToKVPoolAllocator(64), eviction_policy="adaptive")
    assert isinstance(cache.policy, AdaptivePolicy)


def test_its_base_expert_learns_what_frequency_pays_without_switching():
    trace = hot_and_scan()
    lru = simulate_cache(trace, "lru", kv_tokens=2_000).hit_rate
    policy = AdaptivePolicy(margin=0.99)  # never leaves its base expert
    rate = simulate_cache(trace, policy, kv_tokens=2_000, check_invariants=True).hit_rate
    assert not policy.switches and policy.mode == "lru"
    never_hit, *hit = policy._base.tolerance
    assert all(t > never_hit for t in hit)
    assert rate > lru + 0.05
