"""The waiting queue: arrival order per priority bucket, O(1) removal, starving heads."""

from __future__ import annotations

import random

import pytest
from sched_helpers import make_scheduler, req

from radixserve.cache import RadixCache, TokenToKVPoolAllocator
from radixserve.sched import make_schedule_policy
from radixserve.sched.policy import admission_order
from radixserve.sched.queue import WaitingQueue


def queued(rid: str, index: int, priority: int = 0, queued_time: float = 0.0, new: int = 4):
    r = req(rid, [index % 50 + 1, 2, 3], max_new_tokens=new, priority=priority)
    r.arrival_index, r.queued_time = index, queued_time
    return r


@pytest.mark.parametrize("by_priority", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_the_queue_agrees_with_a_sorted_list_under_random_operations(by_priority, seed):
    rng = random.Random(seed)
    queue = WaitingQueue(by_priority=by_priority)
    model: list = []
    made = [queued(f"r{i}", i, priority=rng.choice([0, 0, 1, 5])) for i in range(600)]
    fresh = iter(made)
    added: list = []
    for _ in range(3_000):
        roll = rng.random()
        if roll < 0.45:
            r = next(fresh, None)
            if r is not None:
                queue.add(r)
                model.append(r)
                added.append(r)
        elif roll < 0.85 and model:
            r = rng.choice(model)
            queue.remove(r)
            model.remove(r)
        else:  # a retraction: a request that left comes back to its arrival position
            gone = [r for r in added if r not in model]
            if gone:
                r = rng.choice(gone)
                queue.add(r)
                model.append(r)
        key = (lambda r: (-r.priority, r.arrival_index)) if by_priority else None
        expected = sorted(model, key=key or (lambda r: r.arrival_index))
        assert list(queue) == expected
        assert len(queue) == len(model) and bool(queue) == bool(model)


def test_a_request_cannot_be_queued_twice_and_removal_is_checked():
    queue = WaitingQueue()
    r = queued("a", 0)
    queue.add(r)
    with pytest.raises(ValueError, match="already queued"):
        queue.add(r)
    queue.remove(r)
    with pytest.raises(KeyError):
        queue.remove(r)
    assert r not in queue and not queue


def test_starving_requests_are_read_from_the_head():
    queue = WaitingQueue(by_priority=True)
    reqs = [queued(f"r{i}", i, priority=i % 2, queued_time=float(i)) for i in range(10_000)]
    for r in reqs:
        queue.add(r)
    starving = queue.starving(now=10.0, max_wait=7.0)
    assert [r.rid for r in starving] == ["r0", "r1", "r2", "r3"]
    late = queued("retracted", 5_000, queued_time=9.5)
    late.num_retractions = 1
    queue.remove(reqs[5_000])
    queue.add(late)
    assert [r.rid for r in queue.starving(now=20.0, max_wait=10.1)][-1] == "r9"


def _cache() -> RadixCache:
    return RadixCache(TokenToKVPoolAllocator(4096))


def test_reordering_policies_see_a_window_of_the_oldest_requests():
    queue = WaitingQueue()
    for i in range(10):
        queue.add(queued(f"r{i}", i, new=i + 1))
    lof = make_schedule_policy("lof", lpm_fallback_queue_len=4)
    order = [r.rid for r in admission_order(queue, lof, _cache(), 0.0)]
    assert order == ["r3", "r2", "r1", "r0", *(f"r{i}" for i in range(4, 10))]
    lpm = make_schedule_policy("lpm", lpm_fallback_queue_len=4)
    assert [r.rid for r in admission_order(queue, lpm, _cache(), 0.0)] == [
        f"r{i}" for i in range(10)
    ], "lpm above its window falls back to arrival order, as SGLang's does"


def test_a_long_queue_costs_a_cache_aware_step_no_prefix_lookups():
    sched = make_scheduler(schedule_policy="lpm", max_running_requests=4)
    calls = 0
    real_peek = sched.cache.peek_node

    def counting_peek(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real_peek(*args, **kwargs)

    sched.cache.peek_node = counting_peek
    for i in range(2_000):
        sched.add_request(req(f"r{i}", [i % 7 + 1, 2, 3, i + 10], max_new_tokens=2))
    batch = sched.step()
    assert len(batch) == 4 and calls == 0
    assert [e.req.rid for e in batch.entries] == ["r0", "r1", "r2", "r3"]
