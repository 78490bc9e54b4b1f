"""Scheduler: batches, prefix reuse, chunked prefill, stop conditions, retraction, abort."""

from __future__ import annotations

import numpy as np
import pytest
from sched_helpers import counting_model, make_scheduler, req, run_to_completion

from radixserve.errors import InvalidArgumentError
from radixserve.sched import ForwardMode, ReqState, SamplingParams


def test_one_request_prefills_then_decodes_to_length():
    sched = make_scheduler()
    r = req("a", [1, 2, 3, 4, 5], max_new_tokens=3)
    sched.add_request(r)
    batch = sched.step()
    assert batch.mode is ForwardMode.EXTEND and len(batch) == 1
    entry = batch.entries[0]
    assert entry.token_ids.tolist() == [1, 2, 3, 4, 5] and entry.sample
    assert entry.prefix_slots.size == 0 and entry.new_slots.size == 5
    sched.process_batch_result(batch, counting_model(batch))
    sched.check_invariants()
    batch = sched.step()
    assert batch.mode is ForwardMode.DECODE
    assert batch.entries[0].token_ids.tolist() == [1005]
    assert batch.entries[0].prefix_slots.size == 5
    done = run_to_completion(sched)
    assert done == [r]
    assert r.output_ids == [1005, 1006, 1007]
    assert r.finish_reason.kind == "length" and r.state is ReqState.FINISHED
    assert sched.cache.total_size() == 7, "prompt and computed output stay cached"


def test_finished_sequence_serves_the_next_request():
    sched = make_scheduler()
    first = req("a", list(range(1, 21)), max_new_tokens=4)
    sched.add_request(first)
    run_to_completion(sched)
    second = req("b", [*range(1, 21), 1020, 1021, 5, 6])
    sched.add_request(second)
    run_to_completion(sched)
    assert second.cached_tokens == 22, "prompt and output of the first request are reused"
    assert sched.stats.cached_prompt_tokens == 22


def test_a_requests_own_chunks_do_not_count_as_hits():
    """Regression: re-pointing a request at the tree's copy of its chunk bumped hit_count, so
    LFU and SLRU saw every chunked prompt as reused."""
    sched = make_scheduler(chunked_prefill_size=8)
    sched.add_request(req("a", list(range(1, 31)), max_new_tokens=2))
    run_to_completion(sched)
    nodes = sched.cache._nodes()
    assert nodes and all(node.hit_count == 0 for node in nodes)
    sched.add_request(req("b", [*range(1, 31), 9]))
    run_to_completion(sched)
    prompt_path = sched.cache.match_prefix(np.arange(1, 31, dtype=np.int32), count_hit=False)
    assert prompt_path.last_node.hit_count == 1, "b's reuse is the one hit"


def test_prefix_is_shared_while_the_first_request_still_decodes():
    sched = make_scheduler()
    sched.add_request(req("a", list(range(1, 41)), max_new_tokens=50))
    sched.run_step(counting_model)
    sched.run_step(counting_model)
    b = req("b", [*range(1, 41), 7, 7])
    sched.add_request(b)
    sched.run_step(counting_model)
    assert b.cached_tokens == 40
    sched.check_invariants()
    run_to_completion(sched)


def test_identical_prompt_still_computes_its_last_token():
    sched = make_scheduler()
    sched.add_request(req("a", [1, 2, 3, 4]))
    run_to_completion(sched)
    again = req("b", [1, 2, 3, 4])
    sched.add_request(again)
    batch = sched.step()
    assert batch.entries[0].token_ids.tolist() == [4]
    assert again.cached_tokens == 3
    sched.process_batch_result(batch, counting_model(batch))
    run_to_completion(sched)


def test_stop_token_and_eos_rules():
    sched = make_scheduler()
    stop = req("stop", [1, 2], sampling=SamplingParams(max_new_tokens=10, stop_token_ids={1004}))
    eos = req("eos", [3, 4, 5], eos_token_ids={1005}, max_new_tokens=10)
    ignore = req(
        "ignore",
        [6, 7, 8],
        eos_token_ids={1005},
        sampling=SamplingParams(max_new_tokens=3, ignore_eos=True),
    )
    for r in (stop, eos, ignore):
        sched.add_request(r)
    run_to_completion(sched)
    assert stop.output_ids == [1002, 1003, 1004] and stop.finish_reason.kind == "stop"
    assert stop.finish_reason.matched == 1004
    assert eos.output_ids == [1003, 1004, 1005] and eos.finish_reason.kind == "stop"
    assert ignore.output_ids == [1003, 1004, 1005] and ignore.finish_reason.kind == "length"


def test_zero_max_new_tokens_ends_after_prefill():
    sched = make_scheduler()
    r = req("a", [1, 2, 3], max_new_tokens=0)
    sched.add_request(r)
    run_to_completion(sched)
    assert r.output_ids == [] and r.finish_reason.kind == "length"


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_uses_whole_page_chunks_and_caches_each(page_size):
    sched = make_scheduler(page_size=page_size, chunked_prefill_size=30)
    prompt = list(range(1, 101))
    r = req("a", prompt, max_new_tokens=2)
    sched.add_request(r)
    chunk = 30 - 30 % page_size
    seen = 0
    while seen < 100:
        batch = sched.step()
        assert batch.mode is ForwardMode.EXTEND
        (entry,) = batch.entries
        assert entry.prefix_slots.size == seen
        size = len(entry.token_ids)
        assert size == min(chunk, 100 - seen)
        assert entry.sample == (seen + size == 100)
        sched.process_batch_result(batch, counting_model(batch))
        sched.check_invariants()
        seen += size
        cached = sched.cache.peek_prefix(np.array(prompt, dtype=np.int32))
        assert cached == seen - seen % page_size, "each chunk is visible to others at once"
    assert r.output_ids == [1100]
    run_to_completion(sched)


def test_continuing_chunk_comes_before_new_requests():
    sched = make_scheduler(chunked_prefill_size=16)
    long = req("long", list(range(1, 41)))
    sched.add_request(long)
    sched.run_step(counting_model)
    sched.add_request(req("short", [99, 98]))
    batch = sched.step()
    assert batch.entries[0].req is long
    sched.process_batch_result(batch, counting_model(batch))
    run_to_completion(sched)


def test_a_request_that_can_never_fit_fails_with_a_reason():
    sched = make_scheduler(pool=64)
    r = req("big", list(range(1, 61)), max_new_tokens=10)
    sched.add_request(r)
    (done,) = sched.pop_finished()
    assert done is r and r.finish_reason.kind == "abort"
    assert "70 KV slots" in r.finish_reason.message and "64" in r.finish_reason.message
    assert not sched.has_work()


def test_duplicate_ids_and_reused_requests_are_refused():
    sched = make_scheduler()
    r = req("a", [1, 2])
    sched.add_request(r)
    with pytest.raises(InvalidArgumentError, match="already"):
        sched.add_request(req("a", [3]))
    run_to_completion(sched)
    with pytest.raises(InvalidArgumentError, match="fresh"):
        sched.add_request(r)


def test_abort_frees_everything_in_every_state():
    sched = make_scheduler(chunked_prefill_size=8)
    waiting = req("waiting", [50, 51, 52])
    chunking = req("chunking", list(range(1, 30)), max_new_tokens=50)
    sched.add_request(chunking)
    sched.run_step(counting_model)
    sched.add_request(waiting)
    assert chunking.state is ReqState.PREFILLING
    assert sched.abort("chunking") and sched.abort("waiting")
    sched.check_invariants()
    running = req("running", list(range(1, 12)), max_new_tokens=50)
    sched.add_request(running)
    sched.run_step(counting_model)
    sched.run_step(counting_model)
    sched.run_step(counting_model)
    assert running.state is ReqState.RUNNING
    assert sched.abort("running")
    assert not sched.abort("running") and not sched.abort("nobody")
    sched.check_invariants()
    done = sched.pop_finished()
    assert [r.rid for r in done] == ["chunking", "waiting", "running"]
    assert all(r.finish_reason.kind == "abort" for r in done)
    assert sched.cache.protected_size() == 0
    assert not sched.has_work()


def test_retraction_requeues_without_loss_or_leak():
    # An optimistic reserve admits all six; their outputs then outgrow the pool.
    sched = make_scheduler(pool=160, init_new_token_ratio=0.1, min_new_token_ratio=0.1)
    reqs = [req(f"r{i}", [i + 1] * 10 + list(range(100, 110)), max_new_tokens=60) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    done = run_to_completion(sched)
    assert sched.stats.retractions > 0
    assert sorted(r.rid for r in done) == sorted(r.rid for r in reqs)
    assert len(done) == len(reqs), "every request finishes exactly once"
    for r in reqs:
        assert r.finish_reason.kind == "length"
        expected = [1000 + len(r.input_ids) + k for k in range(60)]
        assert r.output_ids == expected, "a recomputed request continues where it stopped"
    assert sched.cache.protected_size() == 0


def test_new_token_ratio_decays_per_decode_step_and_resets_on_retraction():
    sched = make_scheduler(
        init_new_token_ratio=0.7, min_new_token_ratio=0.5, new_token_ratio_decay=0.1
    )
    sched.add_request(req("a", [1, 2, 3], max_new_tokens=10))
    sched.run_step(counting_model)
    values = []
    for _ in range(4):
        sched.run_step(counting_model)
        values.append(round(sched.ratio.value, 6))
    assert values == [0.6, 0.5, 0.5, 0.5]
    sched.ratio.reestimate([])
    assert sched.ratio.value == 0.7


def test_process_batch_result_checks_the_token_count():
    sched = make_scheduler()
    sched.add_request(req("a", [1, 2]))
    batch = sched.step()
    with pytest.raises(InvalidArgumentError, match="next tokens"):
        sched.process_batch_result(batch, [])


def test_max_running_requests_caps_the_batch():
    sched = make_scheduler(max_running_requests=2)
    for i in range(4):
        sched.add_request(req(f"r{i}", [i + 1, 2, 3], max_new_tokens=5))
    batch = sched.step()
    assert len(batch) == 2
    sched.process_batch_result(batch, counting_model(batch))
    assert len(sched.step()) == 2
    run_to_completion(sched)


def test_priority_preemption_retracts_only_past_the_threshold():
    sched = make_scheduler(
        max_running_requests=1, enable_priority_scheduling=True, priority_preemption_threshold=5
    )
    low = req("low", [1, 2, 3], max_new_tokens=20, priority=0)
    sched.add_request(low)
    sched.run_step(counting_model)
    near = req("near", [4, 5, 6], max_new_tokens=2, priority=5)
    sched.add_request(near)
    assert sched.step().mode is ForwardMode.DECODE, "a gap of 5 does not exceed 5"
    high = req("high", [7, 8, 9], max_new_tokens=2, priority=6)
    sched.add_request(high)
    batch = sched.step()
    assert batch.mode is ForwardMode.EXTEND and batch.entries[0].req is high
    assert low.state is ReqState.WAITING and low.num_retractions == 1
    assert list(sched.waiting) == [near, low], "by priority bucket, then arrival order"
    assert sched.stats.preemptions == 1
    sched.process_batch_result(batch, counting_model(batch))
    done = run_to_completion(sched)
    assert {r.rid for r in done} == {"low", "near", "high"}
    assert len(low.output_ids) == 20


def test_a_mixed_chunk_carries_one_decode_per_running_request_after_the_prefill():
    sched = make_scheduler(chunked_prefill_size=8, enable_mixed_chunk=True)
    sched.add_request(req("a", [1, 2, 3], max_new_tokens=20))
    sched.add_request(req("b", [4, 5, 6], max_new_tokens=20))
    sched.run_step(counting_model)  # both prefilled together; both run from here
    sched.add_request(req("long", list(range(100, 130)), max_new_tokens=2))
    batch = sched.step()
    assert batch.mode is ForwardMode.EXTEND
    kinds = [(e.req.rid, e.is_decode) for e in batch.entries]
    # The prefill budget shrinks by the two decode tokens: 6 prompt tokens ride along.
    assert kinds == [("long", False), ("a", True), ("b", True)]
    assert len(batch.entries[0].token_ids) == 6
    outputs_before = {r.rid: len(r.output_ids) for r in sched.running}
    sched.process_batch_result(batch, counting_model(batch))
    sched.check_invariants()
    assert {r.rid: len(r.output_ids) for r in sched.running} == {
        rid: n + 1 for rid, n in outputs_before.items()
    }
    assert sched.stats.mixed_batches == 1 and sched.prefilling.rid == "long"
    finished = run_to_completion(sched)
    assert {r.rid for r in finished} == {"a", "b", "long"}
    assert all(
        r.output_ids == [1000 + len(r.input_ids) + i for i in range(len(r.output_ids))]
        for r in finished
    )
