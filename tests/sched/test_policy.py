"""Queue orderings, priority, anti-starvation and in-batch prefix deferral."""

from __future__ import annotations

import numpy as np
import pytest
from sched_helpers import StepClock, counting_model, make_scheduler, req, run_to_completion

from radixserve.cache import RadixCache, TokenToKVPoolAllocator
from radixserve.errors import InvalidArgumentError
from radixserve.sched import ForwardMode, make_schedule_policy, order_queue


def cache_with(*seqs) -> RadixCache:
    cache = RadixCache(TokenToKVPoolAllocator(4096))
    for seq in seqs:
        key = np.asarray(seq, dtype=np.int32)
        cache.insert(key, cache.allocator.alloc(len(key)))
    return cache


def rids(reqs) -> list[str]:
    return [r.rid for r in reqs]


def test_lpm_orders_by_cached_length_with_ties_in_queue_order():
    cache = cache_with([1, 2, 3, 4, 5, 6], [9, 9, 9])
    waiting = [
        req("cold", [7, 7, 7]),
        req("three", [9, 9, 9, 1]),
        req("five", [1, 2, 3, 4, 5, 0]),
        req("two", [1, 2, 0]),
        req("three-again", [9, 9, 9, 2]),
    ]
    ordered = order_queue(waiting, make_schedule_policy("lpm"), cache, now=0)
    assert rids(ordered) == ["five", "three", "three-again", "two", "cold"]


def test_lpm_falls_back_to_fcfs_above_the_queue_threshold():
    cache = cache_with([1, 2, 3, 4])
    waiting = [req("cold", [8, 8]), req("hot", [1, 2, 3, 4, 5])]
    policy = make_schedule_policy("lpm", lpm_fallback_queue_len=1)
    assert rids(order_queue(waiting, policy, cache, now=0)) == ["cold", "hot"]
    policy = make_schedule_policy("lpm", lpm_fallback_queue_len=2)
    assert rids(order_queue(waiting, policy, cache, now=0)) == ["hot", "cold"]


def test_dfs_weight_runs_the_heavier_subtree_first():
    cache = cache_with([1, 1, 1, 1], [2, 2, 2, 2], [1, 1, 1, 1, 5, 5])
    waiting = [
        req("b1", [2, 2, 2, 2, 0]),
        req("cold", [3]),
        req("a1", [1, 1, 1, 1, 0]),
        req("a-deep", [1, 1, 1, 1, 5, 5, 0]),
        req("a2", [1, 1, 1, 1, 7]),
    ]
    ordered = order_queue(waiting, make_schedule_policy("dfs-weight"), cache, now=0)
    assert rids(ordered) == ["a-deep", "a1", "a2", "b1", "cold"]


def test_fcfs_and_lof_keep_their_orders_including_priority_ties():
    cache = cache_with()
    waiting = [
        req("p0-short", [1], max_new_tokens=2, priority=0),
        req("p1-long", [2], max_new_tokens=9, priority=1),
        req("p0-long", [3], max_new_tokens=9, priority=0),
        req("p1-short", [4], max_new_tokens=2, priority=1),
    ]
    fcfs, lof = make_schedule_policy("fcfs"), make_schedule_policy("lof")
    assert rids(order_queue(waiting, fcfs, cache, 0)) == rids(waiting)
    assert rids(order_queue(waiting, lof, cache, 0)) == [
        "p1-long",
        "p0-long",
        "p0-short",
        "p1-short",
    ]
    assert rids(order_queue(waiting, fcfs, cache, 0, enable_priority=True)) == [
        "p1-long",
        "p1-short",
        "p0-short",
        "p0-long",
    ]
    assert rids(order_queue(waiting, lof, cache, 0, enable_priority=True)) == [
        "p1-long",
        "p1-short",
        "p0-long",
        "p0-short",
    ]


def test_random_is_seeded():
    cache = cache_with()
    waiting = [req(f"r{i}", [i + 1]) for i in range(20)]
    first = rids(order_queue(waiting, make_schedule_policy("random", seed=3), cache, 0))
    again = rids(order_queue(waiting, make_schedule_policy("random", seed=3), cache, 0))
    other = rids(order_queue(waiting, make_schedule_policy("random", seed=4), cache, 0))
    assert first == again and first != other and sorted(first) == sorted(rids(waiting))


def test_unknown_policy_names_the_choices():
    with pytest.raises(InvalidArgumentError, match="lpm"):
        make_schedule_policy("sjf")


def test_starving_requests_go_first_oldest_first():
    cache = cache_with([1, 2, 3])
    # In arrival order, so queue times grow along the queue, as a scheduler sets them.
    waiting = [req("cold-old", [6]), req("cold-new", [5]), req("hot", [1, 2, 3, 4])]
    waiting[0].queued_time, waiting[1].queued_time, waiting[2].queued_time = 1.0, 4.0, 9.0
    policy = make_schedule_policy("lpm")
    assert rids(order_queue(waiting, policy, cache, now=10.0, max_queue_wait=None)) == [
        "hot",
        "cold-old",
        "cold-new",
    ]
    assert rids(order_queue(waiting, policy, cache, now=10.0, max_queue_wait=6.0)) == [
        "cold-old",
        "cold-new",
        "hot",
    ]


def _hot_stream_wait(max_queue_wait):
    """Queueing delay of one cold request under lpm while hot requests keep arriving."""
    clock = StepClock()
    sched = make_scheduler(
        clock=clock, schedule_policy="lpm", max_running_requests=1, max_queue_wait=max_queue_wait
    )
    hot_prefix = list(range(1, 65))
    sched.add_request(req("seed", hot_prefix, max_new_tokens=1))
    run_to_completion(sched)
    cold = req("cold", [500, 501, 502], max_new_tokens=2)
    sched.add_request(cold)
    for i in range(60):
        clock.now += 1.0
        sched.add_request(req(f"hot{i}", [*hot_prefix, 200 + i], max_new_tokens=2))
        sched.run_step(counting_model)
        sched.check_invariants()
        sched.pop_finished()
        if cold.first_scheduled_time is not None:
            break
    return (
        None if cold.first_scheduled_time is None else cold.first_scheduled_time - cold.queued_time
    )


def test_anti_starvation_lets_a_cold_request_through_within_its_bound():
    assert _hot_stream_wait(None) is None, "without ageing lpm starves the cold request"
    waited = _hot_stream_wait(5.0)
    assert waited is not None and waited <= 5.0 + 3.0  # the bound plus one running request


@pytest.mark.parametrize("shared, deferred", [(32, True), (31, False)])
def test_in_batch_deferral_at_exactly_32_shared_tokens(shared, deferred):
    sched = make_scheduler(schedule_policy="lpm")
    first = req("first", list(range(1, 41)))
    second = req("second", list(range(1, shared + 1)) + [999] * (40 - shared))
    sched.add_request(first)
    sched.add_request(second)
    batch = sched.step()
    assert batch.mode is ForwardMode.EXTEND
    assert rids(e.req for e in batch.entries) == (["first"] if deferred else ["first", "second"])
    sched.process_batch_result(batch, counting_model(batch))
    if deferred:
        batch = sched.step()
        assert rids(e.req for e in batch.entries) == ["second"]
        assert second.cached_tokens == 32, "the deferred request hits the first one's prefix"
        sched.process_batch_result(batch, counting_model(batch))
    run_to_completion(sched)


def test_in_batch_deferral_thresholds_are_configurable_and_fcfs_never_defers():
    prompts = (list(range(1, 41)), list(range(1, 33)) + [999] * 8)
    for config, expected in (
        ({"schedule_policy": "lpm", "in_batch_prefix_defer_threshold": 33}, 2),
        ({"schedule_policy": "lpm", "enable_in_batch_prefix_caching": False}, 2),
        ({"schedule_policy": "fcfs"}, 2),
        ({"schedule_policy": "dfs-weight"}, 1),
    ):
        sched = make_scheduler(**config)
        for i, prompt in enumerate(prompts):
            sched.add_request(req(f"r{i}", prompt))
        assert len(sched.step()) == expected, config


def test_in_batch_deferral_works_above_the_window_and_skips_at_most_the_window():
    # Regression: with the queue longer than lpm's window (served in arrival order), requests
    # sharing a prefix with one admitted this round must still wait for it to be cached.
    sched = make_scheduler(schedule_policy="lpm", lpm_fallback_queue_len=3)
    shared = list(range(1, 33))
    for i in range(8):
        sched.add_request(req(f"s{i}", [*shared, 100 + i, 200 + i]))
    sched.add_request(req("other", [500, *range(600, 640)]))
    batch = sched.step()
    assert rids(e.req for e in batch.entries) == ["s0", "s4", "s5", "s6", "s7", "other"], (
        "three of the shared requests are deferred (the window), then the scan goes on"
    )
    sched.process_batch_result(batch, counting_model(batch))
    batch = sched.step()
    assert rids(e.req for e in batch.entries) == ["s1"]
    assert batch.entries[0].req.cached_tokens == 32, "it reuses s0's prefix"
    sched.process_batch_result(batch, counting_model(batch))
    run_to_completion(sched)
