"""Admission arithmetic: reserves, page rounding, chunk sizes, the budget, the first request."""

from __future__ import annotations

import pytest
from sched_helpers import counting_model, make_scheduler, req, run_to_completion

from radixserve.errors import InvalidArgumentError
from radixserve.sched import ForwardMode, Req, SamplingParams, SchedulerConfig
from radixserve.sched.admission import NewTokenRatio, chunk_tokens, future_need, output_reserve
from radixserve.sched.request import pages


def test_pages_round_up():
    assert [pages(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]
    assert pages(7, 1) == 7


def test_output_reserve_clips_scales_and_rounds_to_pages():
    r = req("a", [1, 2, 3], max_new_tokens=100)
    assert output_reserve(r, ratio=0.7, clip=4096, page_size=1) == 70
    assert output_reserve(r, ratio=0.7, clip=50, page_size=1) == 35
    assert output_reserve(r, ratio=0.33, clip=4096, page_size=1) == 33
    assert output_reserve(r, ratio=0.331, clip=4096, page_size=16) == 48  # ceil(33.1)=34 -> 48
    r.output_ids.extend([0] * 90)
    assert output_reserve(r, ratio=1.0, clip=4096, page_size=1) == 10


def test_future_need_counts_the_rest_of_the_prompt_in_pages():
    r = req("a", list(range(1, 11)), max_new_tokens=10)
    assert future_need(r, ratio=0.5, clip=4096, page_size=4) == 12 + 8
    r.kv_allocated = 8
    assert future_need(r, ratio=0.5, clip=4096, page_size=4) == 4 + 8


def test_chunk_tokens_takes_whole_pages_unless_everything_fits():
    assert chunk_tokens(10, 30, 4) == 10
    assert chunk_tokens(100, 30, 4) == 28
    assert chunk_tokens(100, 3, 4) == 0
    assert chunk_tokens(100, 30, 1) == 30


def test_new_token_ratio_validates_and_reestimates_from_progress():
    with pytest.raises(InvalidArgumentError):
        NewTokenRatio(init=0.5, floor=0.6)
    ratio = NewTokenRatio(init=0.7, floor=0.1, decay=0.25)
    ratio.step()
    ratio.step()
    ratio.step()
    assert ratio.value == pytest.approx(0.1)
    a, b = req("a", [1], max_new_tokens=100), req("b", [2], max_new_tokens=100)
    a.output_ids.extend([0] * 30)
    ratio.reestimate([a, b])
    assert ratio.value == pytest.approx((30 + 20 * 2) / 200)


def test_budget_admits_while_reserves_fit_and_defers_the_rest():
    # pool 100; each request: 20 prompt + ceil(40 * 0.5) = 20 reserved -> 40 per request.
    sched = make_scheduler(pool=100, init_new_token_ratio=0.5, min_new_token_ratio=0.5)
    for i in range(3):
        sched.add_request(req(f"r{i}", [i + 1] * 20, max_new_tokens=40))
    batch = sched.step()
    assert [e.req.rid for e in batch.entries] == ["r0", "r1"]
    sched.process_batch_result(batch, counting_model(batch))
    # Budget now: available 60 + evictable 0 - reserved 2 * (40 - 1) * 0.5 -> 60 - 40 = 20 < 40.
    assert sched.step().mode is ForwardMode.DECODE
    done = run_to_completion(sched)
    assert sorted(r.rid for r in done) == ["r0", "r1", "r2"]


def test_first_request_is_admitted_when_its_chunk_fits_at_all():
    # 60 prompt + 40 reserved outputs exceed the 90 free slots left beside a 10-slot lock,
    # but nothing runs, so the request goes in.
    sched = make_scheduler(pool=100, init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    sched.allocator.alloc(10)
    sched.add_request(req("big", [5] * 60, max_new_tokens=40))
    assert sched.step() is not None
    # Beside a running request the budget rules: 90 free - (1 slot for its pending token
    # + ceil(79 * 0.7) = 56 for its outputs) = 33 for the newcomer's prompt + 7 reserved.
    for prompt_len, admitted in ((26, True), (27, False)):
        sched = make_scheduler(pool=100)
        sched.add_request(req("small", [1] * 10, max_new_tokens=80))
        sched.run_step(counting_model)
        sched.add_request(req("second", [2] * prompt_len, max_new_tokens=10))  # + 7 reserved
        mode = ForwardMode.EXTEND if admitted else ForwardMode.DECODE
        assert sched.step().mode is mode, prompt_len


def test_paged_admission_allocates_whole_pages_for_prompt_and_decode():
    sched = make_scheduler(pool=64, page_size=4)
    r = req("a", list(range(1, 7)), max_new_tokens=5)
    sched.add_request(r)
    batch = sched.step()
    assert batch.entries[0].new_slots.size == 6
    assert r.kv_allocated == 8
    sched.process_batch_result(batch, counting_model(batch))
    for expected_allocated in (8, 8, 12, 12):  # tokens 6 and 7 fill page 2; 8 opens page 3
        sched.run_step(counting_model)
        sched.check_invariants()
        if r.finished:
            break
        assert r.kv_allocated == expected_allocated
    run_to_completion(sched)


def test_config_validation_names_the_field():
    with pytest.raises(InvalidArgumentError, match="chunked_prefill_size"):
        SchedulerConfig(chunked_prefill_size=0)
    with pytest.raises(InvalidArgumentError, match="schedule_policy"):
        SchedulerConfig(schedule_policy="nope")
    with pytest.raises(InvalidArgumentError, match="max_queue_wait"):
        SchedulerConfig(max_queue_wait=0)
    with pytest.raises(InvalidArgumentError, match="page_size"):
        make_scheduler(pool=64, page_size=16, chunked_prefill_size=8)


def test_sampling_params_validate_every_field():
    for bad in (
        {"max_new_tokens": -1},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"min_p": 2.0},
        {"frequency_penalty": 3.0},
        {"repetition_penalty": 0.0},
        {"seed": -1},
        {"stop": [""]},
        {"stop_token_ids": [-3]},
        {"logprobs": 21},
        {"max_new_tokens": 1.5},
    ):
        with pytest.raises(InvalidArgumentError):
            SamplingParams.from_dict(bad)
    with pytest.raises(InvalidArgumentError, match="unknown"):
        SamplingParams.from_dict({"max_tokens": 3})
    params = SamplingParams.from_dict({"stop": "END", "stop_token_ids": [2, 3]})
    assert params.stop == ("END",) and params.stop_token_ids == frozenset({2, 3})


@pytest.mark.parametrize("bad", [[], [[1, 2]], [1.5], [-1], [2**31]])
def test_req_rejects_bad_input_ids(bad):
    with pytest.raises(InvalidArgumentError):
        Req("a", bad)
    with pytest.raises(InvalidArgumentError):
        Req("", [1])
