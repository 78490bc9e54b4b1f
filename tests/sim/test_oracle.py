"""The infinite-cache bound and the offline Belady oracle."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import RadixCache, TokenToKVPoolAllocator
from radixserve.sched import Req
from radixserve.sim.oracle import BeladyPolicy, infinite_cache, infinite_cache_bound
from radixserve.sim.replay import ReplayConfig, replay
from radixserve.sim.traces import TraceRequest


def trace_of(*prompts, outputs=None):
    outputs = outputs or [None] * len(prompts)
    return [
        TraceRequest(
            f"r{i}",
            float(i),
            np.asarray(p, np.int32),
            len(o) if o is not None else 1,
            None if o is None else np.asarray(o, np.int32),
        )
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]


def test_infinite_bound_by_hand():
    # Prefix tree of the prompts: 1-2-3-{4,5} and 9: 6 edge tokens out of 9.
    trace = trace_of([1, 2, 3, 4], [1, 2, 3, 5], [9])
    assert infinite_cache(trace) == (pytest.approx(1 - 6 / 9), 6)
    # Identical prompts: the second is all hits.
    assert infinite_cache_bound(trace_of([4, 4, 4], [4, 4, 4])) == pytest.approx(0.5)
    # Page size 2: only whole pages count.
    assert infinite_cache_bound(trace_of([1, 2, 3, 4], [1, 2, 3, 5]), page_size=2) == 2 / 8


def test_infinite_bound_counts_quoted_answers():
    trace = trace_of([1, 2], [1, 2, 7, 8, 3], outputs=[[7, 8], [0]])
    assert infinite_cache_bound(trace) == pytest.approx(4 / 7)


def test_replay_never_beats_the_infinite_bound():
    trace = trace_of([1, 2, 3, 4], [1, 2, 3, 5], [9, 9], [1, 2, 3, 4, 6])
    result = replay(trace, ReplayConfig(kv_cache_tokens=10_000))
    assert result.token_hit_rate <= infinite_cache_bound(trace)


# -- Belady against a brute-force optimum ----------------------------------------------------
#
# Unit-size instances: every request's cached part is one page (a single token), so the tree is
# one level of one-token leaves and demand paging's optimum is well defined.


def belady_hits(pages: list[int], capacity: int) -> int:
    trace = trace_of(*[[p, 0] for p in pages])
    policy = BeladyPolicy(trace, page_size=1)
    allocator = TokenToKVPoolAllocator(capacity)
    cache = RadixCache(allocator, eviction_policy=policy)
    policy.bind(cache)
    hits = 0
    for r in trace:
        key = r.input_ids[:1]
        match = cache.match_prefix(key)
        cache.inc_lock_ref(match.last_node)
        req = Req(r.rid, r.input_ids)
        req.last_node = match.last_node
        policy.on_admit(req)
        if match.prefix_len:
            hits += 1
        else:
            if allocator.available_size() == 0:
                cache.evict(1)
            cache.insert(key, allocator.alloc(1))
        cache.dec_lock_ref(match.last_node)
        cache.check_invariants()
    return hits


def optimal_hits(pages: list[int], capacity: int) -> int:
    @functools.cache
    def best(i: int, cached: frozenset) -> int:
        if i == len(pages):
            return 0
        page = pages[i]
        if page in cached:
            return 1 + best(i + 1, cached)
        if len(cached) < capacity:
            return best(i + 1, cached | {page})
        return max(best(i + 1, (cached - {victim}) | {page}) for victim in cached)

    return best(0, frozenset())


@settings(max_examples=150, deadline=None)
@given(
    pages=st.lists(st.integers(1, 6), min_size=1, max_size=14),
    capacity=st.integers(1, 4),
)
def test_belady_equals_the_brute_force_optimum(pages, capacity):
    assert belady_hits(pages, capacity) == optimal_hits(pages, capacity)


def test_belady_prefers_the_deepest_leaf_on_ties():
    # Two leaves never used again: the deeper one (under a shared prefix) leaves first.
    trace = trace_of([1, 2, 3, 0], [5, 0], [1, 2, 9])
    policy = BeladyPolicy(trace, page_size=1)
    cache = RadixCache(TokenToKVPoolAllocator(64), eviction_policy=policy)
    policy.bind(cache)
    cache.insert(np.array([1, 2, 3], np.int32), cache.allocator.alloc(3))
    cache.insert(np.array([5], np.int32), cache.allocator.alloc(1))
    for r in trace[:2]:
        req = Req(r.rid, r.input_ids)
        req.last_node = cache.match_prefix(r.input_ids[:-1]).last_node
        policy.on_admit(req)
    cache.match_prefix(np.array([1, 2, 4], np.int32))  # split [1,2,3] into [1,2] + [3]
    cache.check_invariants()
    assert cache.evict(1) == 1
    assert cache.peek_prefix(np.array([1, 2, 3], np.int32)) == 2, "leaf [3] (depth 3) went first"
    assert cache.peek_prefix(np.array([5], np.int32)) == 1


@pytest.mark.parametrize("workload", ["shared-prefix", "few-shot", "tree-of-thought"])
def test_belady_replay_keeps_the_invariants_and_beats_lru(workload):
    from radixserve.sim.workloads import make_workload

    kwargs = {
        "shared-prefix": {"num_groups": 8, "prompts_per_group": 6, "system_len": 64},
        "few-shot": {"num_subjects": 6, "questions_per_subject": 8, "example_len": 32},
        "tree-of-thought": {"num_trees": 4, "depth": 3, "branching": 2, "problem_len": 64},
    }[workload]
    trace = make_workload(workload, seed=3, **kwargs)
    results = {
        policy: replay(
            trace,
            ReplayConfig(
                eviction_policy=policy,
                cache_fraction=10,
                max_running_requests=1,
                check_invariants=True,
            ),
        )
        for policy in ("lru", "belady")
    }
    assert results["belady"].failed == 0
    assert results["belady"].token_hit_rate >= results["lru"].token_hit_rate
