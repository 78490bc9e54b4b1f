"""The adaptive policy and its shadows: sampled estimates, switching, and the tree's invariants."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

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
from radixserve.cache.adaptive import AdaptivePolicy
from radixserve.cache.hashing import namespace_seed
from radixserve.cache.shadow import (
    GreedyDualShadow,
    LearnedLRUShadow,
    LFUShadow,
    LRUShadow,
    PrefixHasher,
    _Shadow,
)
from radixserve.errors import InvalidArgumentError
from radixserve.sim.cacheonly import simulate_cache
from radixserve.sim.study import study_trace
from radixserve.sim.workloads import make_workload

# -- prefix hashes ------------------------------------------------------------------------------


def _bytes(values) -> bytes:
    return np.asarray(values, dtype=np.int32).tobytes()


def test_a_prefix_hash_does_not_depend_on_where_edges_are_cut():
    hasher = PrefixHasher(block_tokens=4, rate=1.0)
    seed = hasher.seed(b"ns")
    seq = list(range(100, 140))
    end, _, whole = hasher.end_and_samples(seed, _bytes(seq))
    assert len(whole) == 10 and len(set(whole)) == 10
    for cut in (1, 4, 13, 39):
        middle, _, first = hasher.end_and_samples(seed, _bytes(seq[:cut]))
        last, _, rest = hasher.end_and_samples(middle, _bytes(seq[cut:]))
        assert [*first, *rest] == whole and last == end
    _, _, other = hasher.end_and_samples(seed, _bytes([*seq[:21], 999, *seq[22:]]))
    assert other[:5] == whole[:5], "names of blocks ending before the change stay"
    assert not set(other[5:]) & set(whole[5:]), "a changed token renames every later block"
    assert hasher.end_and_samples(hasher.seed(b"other"), _bytes(seq))[2][0] != whole[0]


def test_first_pages_are_named_and_blocks_sampled_at_the_rate():
    paged = PrefixHasher(block_tokens=8, rate=1.0, page_tokens=4)
    seed = paged.seed(b"")
    _, first, _ = paged.end_and_samples(seed, _bytes(range(40)))
    _, _, names = PrefixHasher(block_tokens=4, rate=1.0).end_and_samples(seed, _bytes(range(40)))
    assert first == names[0], "the first page's name is the prefix's name at its end"
    sparse = PrefixHasher(block_tokens=1, rate=0.1)
    seq = np.random.default_rng(0).integers(0, 32_000, 20_000)
    _, _, sampled = sparse.end_and_samples(sparse.seed(b""), _bytes(seq))
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


def test_the_lfu_shadows_written_out_reference_equals_the_base_class_steps():
    # LFUShadow writes its references out for speed; _Shadow.reference defines them. Requests
    # of up to 20 pages overflow the 12-page shadow.
    fast, slow = LFUShadow(12), LFUShadow(12)
    rng = random.Random(5)
    requests = [rng.sample(range(40), rng.choice([1, 2, 3, 6, 20])) for _ in range(2_000)]
    for start in range(0, len(requests), 50):
        batch = requests[start : start + 50]
        if start % 100:
            assert fast.reference_all(batch) == sum(_Shadow.reference(slow, r) for r in batch)
        else:
            assert [fast.reference(r) for r in batch] == [_Shadow.reference(slow, r) for r in batch]
        assert fast._count == slow._count and fast._min == slow._min
    assert {n: list(b) for n, b in fast._buckets.items() if b} == {
        n: list(b) for n, b in slow._buckets.items() if b
    }


def test_the_greedy_dual_shadows_batched_references_equal_the_base_class_steps():
    fast, slow = GreedyDualShadow(12, 0.25, 1.0), GreedyDualShadow(12, 0.25, 1.0)
    rng = random.Random(6)
    requests = [rng.sample(range(30), rng.choice([1, 2, 3, 6])) for _ in range(2_000)]
    for start in range(0, len(requests), 50):
        batch = requests[start : start + 50]
        assert fast.reference_all(batch) == sum(_Shadow.reference(slow, r) for r in batch)
    assert fast._keys == slow._keys and fast._hits == slow._hits
    assert list(fast._ghosts) == list(slow._ghosts) and fast._level == slow._level


class _ScanGreedyDualShadow(GreedyDualShadow):
    """The wgd shadow with its heap replaced by a scan of every key: the plain model."""

    def _pop_least(self) -> tuple:
        return min(self._keys.values())


@pytest.mark.parametrize("capacity", [12, 40])
def test_the_greedy_dual_shadows_heap_evicts_the_least_key(capacity):
    # Hits raise keys without touching the heap; the least key must still leave first, with
    # pages that come back after eviction and pages demoted out of the window.
    fast, plain = GreedyDualShadow(capacity, 0.25, 1.0), _ScanGreedyDualShadow(capacity, 0.25, 1.0)
    rng = random.Random(capacity)
    hot = list(range(capacity // 2))
    requests = [
        rng.sample(hot, 3) if rng.random() < 0.6 else rng.sample(range(3 * capacity), 4)
        for _ in range(6_000)
    ]
    for start in range(0, len(requests), 40):
        batch = requests[start : start + 40]
        assert fast.reference_all(batch) == sum(_Shadow.reference(plain, r) for r in batch)
    assert fast._keys == plain._keys and fast._hits == plain._hits
    assert list(fast._ghosts) == list(plain._ghosts) and fast._level == plain._level
    cached = list(fast._keys)[:3]
    heap = len(fast._heap)
    assert fast.reference_all([cached] * 100) == 300
    assert len(fast._heap) == heap, "a hit costs no heap entry"


def test_a_request_does_not_evict_its_own_pages():
    for shadow in (LRUShadow(4), LFUShadow(4), GreedyDualShadow(4, 0.25, 1.0)):
        assert shadow.reference([3, 2, 1]) == 0
        assert shadow.reference([6, 5, 2, 1]) == 2, "1 and 2 are renewed before 5 and 6 enter"
        assert shadow.reference([2, 1]) == 2
        assert len(shadow) == 4


def test_a_request_larger_than_a_shadow_is_taken():
    # A sample can hold more of one long request's pages than the shadow's capacity.
    for shadow in (LRUShadow(4), LFUShadow(4), GreedyDualShadow(4, 0.25, 1.0)):
        shadow.reference([1, 2])
        assert shadow.reference([2, 1, 9, 8, 7, 6, 5]) == 2
        assert len(shadow) == 4
        assert shadow.reference_all([[3], [2, 1], list(range(20, 30))]) <= 2


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
    counted = [(real, raw["lru"]) for _, _, real, raw in list(policy.decisions)[2:]]
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
        serve_random_prompt(cache, rng, i)
    assert [mode for _, mode in policy.switches] == order
    with pytest.raises(InvalidArgumentError):
        policy.follow("mru")


def test_every_shadow_is_fed_every_sampled_block():
    # A large pool: the shadows sample 1,024 blocks of 64 tokens. The wgd shadow sees them all:
    # at a quarter of the sample its own sampling error was several points (a regression).
    policy = AdaptivePolicy()
    cache = RadixCache(TokenToKVPoolAllocator(400_000), eviction_policy=policy)
    rng = np.random.default_rng(2)
    for _ in range(200):
        cache_sequence(cache, rng.integers(0, 32_000, 1_024).tolist())
    policy._feed_shadows()
    assert policy._hasher.block_bytes == 64 * 4
    assert 0.1 < policy._hasher.rate < 0.25
    assert 300 < policy._refs < 700
    assert policy._refs == len(policy._lru) == len(policy._lfu) == len(policy._gd)
    assert policy._gd.capacity == policy._lru.capacity


def _epochs_with_batch(monkeypatch, batch: int, trace) -> tuple[list, int]:
    import radixserve.cache.adaptive as adaptive

    monkeypatch.setattr(adaptive, "_BATCH", batch)
    changes = []
    changed = adaptive._BaseExpert.tolerance_changed
    monkeypatch.setattr(
        adaptive._BaseExpert, "tolerance_changed", lambda self: (changes.append(1), changed(self))
    )
    policy = AdaptivePolicy(margin=0.99)  # never switches: only the shadows' counts differ
    simulate_cache(trace, policy, cache_fraction=2)
    return list(policy._recent), len(changes)


def test_the_shadows_counts_do_not_depend_on_how_references_are_batched(monkeypatch):
    # The learned-lru shadow evicts by the base expert's tolerances: those in force when its
    # references happened, however many requests are held back (a batch of 16 once read a
    # newer tolerance for the older references of a batch).
    trace = study_trace("chat", scale=0.25)
    one, changes = _epochs_with_batch(monkeypatch, 1, trace)
    assert changes >= 3 and len(one) >= 5, "the tolerances moved while the shadows were fed"
    for batch in (16, 64):
        assert _epochs_with_batch(monkeypatch, batch, trace)[0] == one


def test_a_split_node_is_renamed_consistently():
    clock = ManualClock()
    policy = AdaptivePolicy(sample_pages=10_000)
    cache = RadixCache(TokenToKVPoolAllocator(1_000), eviction_policy=policy, clock=clock)
    cache_sequence(cache, list(range(50)))
    cache_sequence(cache, [*range(20), *range(500, 530)])  # splits the first edge at 20
    upper = cache.match_prefix(tokens(range(20))).last_node
    lower = next(iter(upper.children.values()))
    hasher = policy._hasher
    seed = hasher.seed(b"radixserve" + namespace_seed(None))
    at_split, _, above = hasher.end_and_samples(seed, _bytes(range(20)))
    at_end, _, whole = hasher.end_and_samples(seed, _bytes(range(50)))
    assert policy._names.record(upper)[1] == at_split and policy._names.record(lower)[1] == at_end
    assert policy._names.record(upper)[3] + policy._names.record(lower)[3] == whole and above
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


def _deciding_policy() -> AdaptivePolicy:
    """A policy bound to a 4,096-slot tree that decides every 1,000 sampled references."""
    policy = AdaptivePolicy(epoch=1_000)
    RadixCache(TokenToKVPoolAllocator(4_096), eviction_policy=policy)
    return policy


def _epochs(
    policy: AdaptivePolicy, count: int, real: float, learned: float | None = None, **shadows: float
) -> None:
    """Close `count` epochs in which the tree hit `real` and each shadow its given rate (the
    base expert's shadow, `learned`, the LRU shadow's unless given)."""
    refs = 1_000
    for _ in range(count):
        policy._refs, policy._real, policy._gd_refs = refs, round(real * refs), refs
        policy._hits = {name: round(rate * refs) for name, rate in shadows.items()}
        policy._learned_hits = round((shadows["lru"] if learned is None else learned) * refs)
        policy._decide()


def _switched_to_lfu(base_epochs: int, real: float, lru: float, lfu: float) -> AdaptivePolicy:
    """A policy that decides every epoch (no transition), after `base_epochs` epochs under its
    base expert with these rates, switched to LFU by hand."""
    policy = _deciding_policy()
    _epochs(policy, base_epochs, real=real, lru=lru, lfu=lfu, wgd=0.0)
    policy.follow("lfu")
    return policy


@pytest.mark.parametrize(
    ("base", "paying", "not_paying"),
    [
        # Regression (few-shot at 20% in the study): the LRU shadow stood 2 points above the
        # tree under the base expert, so once the tree followed LFU, the same optimism read as
        # an LRU lead and sent it back, though LFU was ahead. The LFU shadow shares that
        # optimism; a shortfall past the correction still sends the tree back.
        pytest.param(
            (0.30, 0.32, 0.33),
            (16, 0.31, 0.32, 0.33),
            (16, 0.27, 0.32, 0.33),
            id="an-lru-shadow-seen-optimistic-is-lowered",
        ),
        # Regression (popularity-drift at 20%, study seeds 45 and 47): the tree followed LFU
        # and matched LRU's shadow for four epochs, then popularity moved and LFU's shadow
        # fell 4-16 points under LRU's. The mean shortfall since the switch stayed under the
        # margin, and the tree kept LFU to the trace's end: 1.1 and 1.0 points under LRU. The
        # evidence the switch was made on is gone once the shadows turn.
        pytest.param(
            (0.50, 0.50, 0.50),
            (4, 0.52, 0.51, 0.52),
            (1, 0.50, 0.51, 0.43),
            id="the-shadows-turn-after-the-transition",
        ),
    ],
)
def test_after_a_switch_it_keeps_lfu_while_lfu_pays_and_goes_back_when_not(
    base, paying, not_paying
):
    policy = _switched_to_lfu(6, *base)
    for (epochs, real, lru, lfu), mode in ((paying, "lfu"), (not_paying, "lru")):
        _epochs(policy, epochs, real=real, lru=lru, lfu=lfu, wgd=0.0)
        assert policy.mode == mode


def test_a_base_expert_better_than_its_shadow_does_not_raise_lru_after_a_switch():
    policy = _switched_to_lfu(6, real=0.34, lru=0.32, lfu=0.30)
    _epochs(policy, 16, real=0.316, lru=0.32, lfu=0.316, wgd=0.0)
    assert policy.mode == "lfu", "the LRU shadow leads by 0.4 points, under the margin"


def test_one_base_epoch_is_no_evidence_of_the_lru_shadows_optimism():
    # Regression (popularity-drift at 0.5%): a single noisy base-mode epoch 3 points under the
    # LRU shadow kept the tree on LFU long after LFU's counts went stale.
    policy = _switched_to_lfu(1, real=0.27, lru=0.30, lfu=0.30)
    _epochs(policy, 4, real=0.29, lru=0.30, lfu=0.29, wgd=0.0)
    assert policy.mode == "lru"


# -- the base expert's own floor --------------------------------------------------------------


class _Tolerances:
    def __init__(self, tolerance: list[float]) -> None:
        self.tolerance = tolerance


def test_the_learned_lru_shadow_with_equal_tolerances_is_the_lru_shadow():
    rng = random.Random(3)
    seq = [rng.choice(range(rng.choice([20, 60]))) for _ in range(3_000)]
    for tolerated in (0.0, 7.0):
        learned, lru = LearnedLRUShadow(25, _Tolerances([tolerated] * 4), 4), LRUShadow(25)
        hits = [learned.reference([page], float(t)) for t, page in enumerate(seq)]
        assert hits == [lru.reference([page]) for page in seq]
        assert len(learned) == 25


def _plain_lru_request(order: list[int], pages: list[int], capacity: int) -> int:
    """A request on a list ordered oldest first: hits renewed, room made, misses admitted,
    then the hits renewed again, since the new pages are deeper on the request's path."""
    hits = [page for page in pages if page in order]
    misses = len(pages) - len(hits)
    for page in hits:
        order.remove(page)
        order.append(page)
    if misses:
        del order[: max(0, min(len(order), len(order) + misses - capacity))]
        order.extend([page for page in pages if page not in order])  # hits evicted, too
        del order[: max(0, len(order) - capacity)]
        for page in hits:
            if page in order:
                order.remove(page)
                order.append(page)
    return len(hits)


def test_the_written_out_shadows_equal_their_plain_steps():
    # LRU and learned-lru write their references out for speed. Requests of up to 20 pages
    # overflow the 12-page shadows; the tolerances change between batches, as the base
    # expert's do.
    rng = random.Random(7)
    requests = [rng.sample(range(40), rng.choice([1, 2, 3, 6, 20])) for _ in range(2_000)]
    tolerances = _Tolerances([0.0, 5.0, 2.0])
    lru, order = LRUShadow(12), []
    fast, slow = LearnedLRUShadow(12, tolerances, 3), LearnedLRUShadow(12, tolerances, 3)
    for start in range(0, len(requests), 50):
        batch, times = requests[start : start + 50], [float(start + i) for i in range(50)]
        tolerances.tolerance = [0.0, rng.choice([0.0, 5.0, 50.0]), rng.choice([2.0, 20.0])]
        assert lru.reference_all(batch) == sum(_plain_lru_request(order, r, 12) for r in batch)
        assert list(lru._pages) == order
        want = 0
        for pages, now in zip(batch, times, strict=True):
            slow._now = now
            want += _Shadow.reference(slow, pages)
        assert fast.reference_all(batch, times) == want
    assert fast._hits == slow._hits
    assert [list(pages.items()) for pages in fast._lists] == [
        list(pages.items()) for pages in slow._lists
    ]


def test_the_learned_lru_shadow_keeps_a_class_with_a_longer_tolerance():
    learned = LearnedLRUShadow(2, _Tolerances([0.0, 100.0]), 2)
    learned.reference([1], 0.0)
    assert learned.reference([1], 1.0) == 1  # page 1 is now in hit class 1
    learned.reference([2], 2.0)
    learned.reference([3], 3.0)  # evicts 2 (due at 2), not 1 (due at 101)
    assert learned.reference([1], 4.0) == 1 and learned.reference([2], 5.0) == 0


def test_the_tree_ranks_by_plain_recency_while_the_base_experts_shadow_trails_lrus():
    policy = _deciding_policy()
    _epochs(policy, 4, real=0.30, learned=0.298, lru=0.30, lfu=0.0, wgd=0.0)
    assert not policy.plain, "a loss under the margin is not one"
    _epochs(policy, 4, real=0.30, learned=0.28, lru=0.30, lfu=0.0, wgd=0.0)
    assert policy.plain and policy.mode == "lru"
    policy._base.tolerance = [0.0, 9.0, 9.0, 9.0]
    node = SimpleNamespace(last_access_time=5.0, hit_count=3)
    assert policy.key(node) == 5.0 and policy._base.key(node) == 14.0
    _epochs(policy, 16, real=0.30, learned=0.33, lru=0.30, lfu=0.0, wgd=0.0)
    assert not policy.plain, "a clear gain brings the learned tolerances back"
    assert [plain for _, plain in policy.plain_switches] == [True, False]


@pytest.mark.parametrize("floor", [True, False])
def test_a_base_expert_that_learned_harm_is_floored_at_lru(floor):
    # Tolerances that keep every node ever hit: on chat whose sessions end, the tree fills
    # with dead sessions. The base expert's floor notices through its shadow and falls back
    # to plain recency; without the floor the same policy loses to LRU.
    trace = chat_sessions()
    lru = simulate_cache(trace, "lru", kv_tokens=15_000).hit_rate
    policy = AdaptivePolicy()
    bind = policy.bind

    def bind_with_harm(cache):
        bind(cache)
        policy._base.estimate = lambda: [0.0, 1e12, 1e12, 1e12]

    policy.bind = bind_with_harm
    if not floor:
        policy._judge_base_expert = lambda gap: None
    rate = simulate_cache(trace, policy, kv_tokens=15_000, check_invariants=True).hit_rate
    if floor:
        assert policy.plain_switches and rate >= lru - 0.001
    else:
        assert rate < lru - 0.002


# -- the report -------------------------------------------------------------------------------


def test_the_summary_reports_what_the_tree_follows_and_the_shadows_estimates():
    policy = AdaptivePolicy(sample_pages=100_000, margin=0.99)  # samples all, never switches
    RadixCache(TokenToKVPoolAllocator(6_000), eviction_policy=policy)
    fresh = policy.summary()
    assert fresh.following == "learned-lru" and fresh.switches == 0 and fresh.epochs == 0
    assert fresh.estimated_hit_rates == {} and fresh.sample_rate == 1.0
    simulate_cache(chat_sessions(), policy, kv_tokens=6_000)
    summary = policy.summary()
    assert summary.epochs == len(policy.decisions) >= 5
    assert summary.sampled_references == policy.references
    rates = summary.estimated_hit_rates
    assert set(rates) == {"tree", "lru", "lfu", "wgd", "learned-lru"}
    assert all(0.0 <= rate <= 1.0 for rate in rates.values())
    # Over the latest epochs (all of them here, up to 16), reference-weighted.
    ends = [0] + [references for references, *_ in policy.decisions]
    refs = [end - start for start, end in itertools.pairwise(ends)][-16:]
    latest = list(policy.decisions)[-16:]
    tree = sum(r * d[2] for r, d in zip(refs, latest, strict=True)) / sum(refs)
    lru = sum(r * d[3]["lru"] for r, d in zip(refs, latest, strict=True)) / sum(refs)
    assert rates["tree"] == pytest.approx(tree, abs=1e-9)
    assert rates["lru"] == pytest.approx(lru, abs=1e-9)
    assert summary.shadow_entries > 0 and summary.node_records > 0
    policy.follow("lfu")
    assert (policy.summary().following, policy.summary().switches) == ("lfu", 1)
    policy.follow("lru")
    policy._set_plain(True)
    assert policy.summary().following == "lru", "the base expert's floor: plain recency"


def test_the_decision_history_is_bounded():
    # A server runs for days: an epoch every few thousand requests must not grow memory.
    policy = _deciding_policy()
    _epochs(policy, 1_500, real=0.3, lru=0.3, lfu=0.3, wgd=0.3)
    assert policy.epochs == 1_500 and len(policy.decisions) == 1_024
    assert policy.decisions[-1][0] == policy.references == 1_500_000


def _filled_then_switched_to(expert: str) -> AdaptivePolicy:
    """A policy with the default epochs (a transition after each switch), filled under its
    base expert with every shadow alike, then switched to `expert` by hand."""
    policy = AdaptivePolicy()
    RadixCache(TokenToKVPoolAllocator(4_096), eviction_policy=policy)
    _epochs(policy, 4, real=0.45, lru=0.45, lfu=0.45, wgd=0.0)
    policy.follow(expert)
    return policy


def test_it_goes_back_when_the_shadows_turn_during_the_transition():
    # Regression (popularity-drift at 10%, study seed 11): LFU's shadow led for two epochs,
    # the tree switched, and popularity moved; the tree kept LFU through its transition (five
    # epochs), 1.3 points below LRU over the trace. The shadows need no transition.
    policy = _filled_then_switched_to("lfu")
    _epochs(policy, 1, real=0.5, lru=0.55, lfu=0.52, wgd=0.0)
    assert policy.mode == "lfu", "one epoch is not evidence"
    _epochs(policy, 1, real=0.5, lru=0.57, lfu=0.53, wgd=0.0)
    assert policy.mode == "lru" and policy._misses_in_mode == 0


def test_it_keeps_the_switch_while_another_experts_shadow_still_beats_lrus():
    # Regression (system-prompts at 10%, study seed 1): wgd's shadow fell under LRU's after
    # a switch to wgd, but LFU's stayed above both: recency is not what the shadows favour.
    policy = _filled_then_switched_to("wgd")
    _epochs(policy, 2, real=0.5, lru=0.47, lfu=0.51, wgd=0.45)
    assert policy.mode == "wgd"


def test_it_goes_back_when_the_tree_trails_lrus_shadow_during_the_transition():
    # Regression (chat-documents at 20%, study seed 32, an eight-epoch trace): the wgd shadow
    # led LRU's by 8 points, 3 after its handicap; under wgd the tree hit 0.36-0.38 against
    # LRU's 0.38-0.40 while the shadow still claimed 0.47. The tree waited out its transition
    # and two epochs of leads, and went back at the trace's last epoch: 1.07 below LRU.
    policy = _filled_then_switched_to("wgd")
    _epochs(policy, 1, real=0.37, lru=0.39, lfu=0.3, wgd=0.47)
    assert policy.mode == "wgd", "one epoch is not evidence"
    _epochs(policy, 1, real=0.36, lru=0.38, lfu=0.3, wgd=0.47)
    assert policy.mode == "lru" and policy._misses_in_mode == 0


def test_a_transition_within_the_margin_of_lrus_shadow_keeps_the_switch():
    policy = _filled_then_switched_to("wgd")
    _epochs(policy, 3, real=0.387, lru=0.39, lfu=0.3, wgd=0.47)
    assert policy.mode == "wgd"


def test_an_unchecked_wgd_shadow_is_handicapped_by_at_most_what_the_reference_hits():
    # A wrong trial of wgd cannot lose more than the tree's rate: where LRU hits nothing (a
    # cycle longer than the cache), a 4-point wgd lead is taken, not held to the 5 points.
    policy = _deciding_policy()
    _epochs(policy, 2, real=0.0, lru=0.0, lfu=0.0, wgd=0.04)
    assert policy.mode == "wgd"
    high = _deciding_policy()
    _epochs(high, 4, real=0.3, lru=0.3, lfu=0.3, wgd=0.34)
    assert high.mode == "lru", "above 5 points of reference rate the full handicap holds"


def test_it_follows_wgd_on_a_cycle_where_lru_and_lfu_hit_nothing():
    # Regression (agent at 5-20% in the study): with the full handicap the tree stayed with
    # its base expert at 0% while wgd hit 10% (this trace at 10%: 0.0 before, 6.0 after).
    trace = make_workload("agent", seed=0, num_agents=64, steps=6)
    assert simulate_cache(trace, "lru", cache_fraction=10.0).hit_rate == 0.0
    wgd = simulate_cache(trace, "wgd", cache_fraction=10.0).hit_rate
    policy = AdaptivePolicy()
    rate = simulate_cache(trace, policy, cache_fraction=10.0, check_invariants=True).hit_rate
    assert policy.mode == "wgd"
    assert 0.03 < rate <= wgd
