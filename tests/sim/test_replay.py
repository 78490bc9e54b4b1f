"""Replays drive the real scheduler and cache, deterministically, and measure what they claim."""

from __future__ import annotations

import math

import numpy as np
import pytest

from radixserve.errors import InvalidArgumentError
from radixserve.sim.costmodel import CostModel
from radixserve.sim.replay import ReplayConfig, replay
from radixserve.sim.traces import TraceRequest
from radixserve.sim.workloads import make_workload

SMALL = {
    "shared-prefix": {"num_groups": 6, "prompts_per_group": 5, "system_len": 64},
    "multi-turn": {"num_sessions": 4, "turns": 4, "system_len": 32},
    "few-shot": {"num_subjects": 4, "questions_per_subject": 6, "example_len": 32},
    "tree-of-thought-shuffled": {"num_trees": 3, "depth": 3, "branching": 2, "problem_len": 64},
    "agent": {"num_agents": 4, "steps": 4, "system_len": 64},
}


@pytest.mark.parametrize("workload", sorted(SMALL))
@pytest.mark.parametrize("schedule", ["fcfs", "lpm", "dfs-weight"])
def test_small_replays_finish_everything_with_invariants_checked(workload, schedule):
    trace = make_workload(workload, seed=0, **SMALL[workload])
    config = ReplayConfig(
        eviction_policy="lru", schedule_policy=schedule, cache_fraction=20, check_invariants=True
    )
    result = replay(trace, config)
    assert result.requests == len(trace) and result.failed == 0
    assert result.prompt_tokens == sum(len(r.input_ids) for r in trace)
    assert result.output_tokens == sum(r.output_len for r in trace)
    assert 0 <= result.token_hit_rate <= 1
    # Every prompt token is either a first-admission hit or computed (recomputation adds more).
    assert result.prefill_tokens_computed + result.cached_prompt_tokens >= result.prompt_tokens
    assert result.token_hit_rate == result.cached_prompt_tokens / result.prompt_tokens
    assert result.ttft_p50 <= result.ttft_p99 <= result.e2e_p99
    assert result.makespan > 0 and result.throughput_tokens_per_s > 0


@pytest.mark.parametrize("workload", sorted(SMALL))
@pytest.mark.parametrize("eviction", ["wgd", "slru", "belady"])
def test_stateful_policies_keep_the_invariants_under_pressure(workload, eviction):
    trace = make_workload(workload, seed=0, **SMALL[workload])
    config = ReplayConfig(
        eviction_policy=eviction,
        cache_fraction=5,
        arrivals="burst",
        max_running_requests=3,
        check_invariants=True,
    )
    result = replay(trace, config)
    assert result.failed == 0 and result.evicted_tokens > 0


def test_a_replay_under_adaptive_carries_the_policy_s_account():
    trace = make_workload("multi-turn", seed=0, **SMALL["multi-turn"])
    config = ReplayConfig(eviction_policy="adaptive", cache_fraction=5, check_invariants=True)
    summary = replay(trace, config).policy_summary
    assert summary is not None and summary["following"] in ("learned-lru", "lru", "lfu", "wgd")
    assert summary["sampled_references"] > 0 and summary["node_records"] > 0
    assert replay(trace, ReplayConfig(cache_fraction=5)).policy_summary is None


def test_replays_are_deterministic():
    trace = make_workload("multi-turn", seed=0, **SMALL["multi-turn"])
    config = ReplayConfig(schedule_policy="lpm", cache_fraction=5)
    a, b = replay(trace, config).as_dict(), replay(trace, config).as_dict()
    for volatile in ("wall_seconds", "sched_cache_us_per_request"):
        a.pop(volatile), b.pop(volatile)
    assert a == b


def test_a_follow_up_is_sent_after_its_parent_and_reuses_the_answer():
    parent = TraceRequest(
        "p", 0.0, np.arange(1, 9, dtype=np.int32), 4, np.array([50, 51, 52, 53], np.int32)
    )
    child = TraceRequest(
        "c", 0.0, np.array([*range(1, 9), 50, 51, 52, 53, 7, 7], np.int32), 2, after="p"
    )
    result = replay([parent, child], ReplayConfig(kv_cache_tokens=1000, arrivals="burst"))
    # The child reuses the parent's 8 prompt tokens and the KV of 3 of its 4 answer tokens
    # (the last answer token was sampled but never fed back through the model).
    assert result.token_hit_rate == pytest.approx(11 / 22)


def test_bad_dependencies_are_refused():
    a = TraceRequest("a", 0.0, np.array([1], np.int32), 1, after="b")
    b = TraceRequest("b", 0.0, np.array([2], np.int32), 1, after="a")
    with pytest.raises(InvalidArgumentError, match="never finishes"):
        replay([a, b], ReplayConfig(kv_cache_tokens=100))
    lost = TraceRequest("x", 0.0, np.array([1], np.int32), 1, after="nobody")
    with pytest.raises(InvalidArgumentError, match="names no other request"):
        replay([lost], ReplayConfig(kv_cache_tokens=100))


def test_capacity_never_drops_below_the_largest_request():
    trace = make_workload("few-shot", seed=0, **SMALL["few-shot"])
    result = replay(trace, ReplayConfig(cache_fraction=0.01))
    largest = max(len(r.input_ids) + r.output_len for r in trace)
    assert result.kv_tokens == largest and result.kv_tokens_requested < largest
    assert result.failed == 0


def test_cost_model_prices_prefill_attention_and_decode():
    cost = CostModel(
        prefill_per_token=1.0, prefill_attention_per_pair=0.1, prefill_batch_overhead=0.0
    )
    assert cost.prefill_time(new_tokens=4, prefix_tokens=10) == pytest.approx(4 + 0.1 * 4 * 12)
    cached_is_cheaper = cost.prefill_time(4, 0) < cost.prefill_time(14, 0)
    assert cached_is_cheaper
    with pytest.raises(InvalidArgumentError, match="decode_step"):
        CostModel(decode_step=-1)


def test_config_validation():
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        ReplayConfig()
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        ReplayConfig(kv_cache_tokens=5, cache_fraction=5)
    with pytest.raises(InvalidArgumentError, match="arrivals"):
        ReplayConfig(kv_cache_tokens=5, arrivals="now")
    with pytest.raises(InvalidArgumentError, match="empty"):
        replay([], ReplayConfig(kv_cache_tokens=5))
    for page_size in (0, -4, 2.5):  # regression: 0 raised ZeroDivisionError sizing the pool
        with pytest.raises(InvalidArgumentError, match="page_size"):
            ReplayConfig(kv_cache_tokens=5, page_size=page_size)


def test_disabled_cache_computes_every_prompt_token():
    trace = make_workload("shared-prefix", seed=0, **SMALL["shared-prefix"])
    result = replay(trace, ReplayConfig(cache_fraction=50, enable_radix_cache=False))
    assert result.token_hit_rate == 0
    assert result.prefill_tokens_computed >= result.prompt_tokens
    assert not math.isnan(result.ttft_p99)


def test_arrival_modes_are_parsed_and_bad_ones_refused():
    from radixserve.sim.replay import parse_arrivals

    assert parse_arrivals("trace") == ("trace", 0.0)
    assert parse_arrivals("scaled:2.5") == ("scaled", 2.5)
    assert parse_arrivals("closed-loop:8") == ("closed-loop", 8.0)
    for bad in ("poisson", "scaled:0", "scaled:x", "closed-loop:0", "closed-loop:1.5", "burst:2"):
        with pytest.raises(InvalidArgumentError, match="arrivals must be"):
            ReplayConfig(cache_fraction=5, arrivals=bad)


def test_closed_loop_clients_never_queue_and_scaling_compresses_time():
    trace = make_workload("shared-prefix", seed=0, rate=2.0, **SMALL["shared-prefix"])
    one = replay(trace, ReplayConfig(cache_fraction=50, arrivals="closed-loop:1"))
    eight = replay(trace, ReplayConfig(cache_fraction=50, arrivals="closed-loop:8"))
    assert one.failed == eight.failed == 0
    assert one.queue_delay_p99 == pytest.approx(0, abs=1e-9), "one client: never a queue"
    assert eight.makespan < one.makespan
    base = replay(trace, ReplayConfig(cache_fraction=50))
    fast = replay(trace, ReplayConfig(cache_fraction=50, arrivals="scaled:2"))
    assert fast.makespan < 0.6 * base.makespan
    assert fast.offered_load == pytest.approx(2 * base.offered_load)


def test_offered_load_is_prefill_work_over_the_arrival_span():
    from radixserve.sim.replay import offered_load

    cost = CostModel()
    trace = [
        TraceRequest("a", 0.0, np.arange(100, dtype=np.int32), 4),
        TraceRequest("b", 10.0, np.arange(300, dtype=np.int32), 4),
    ]
    work = cost.prefill_time(100, 0) + cost.prefill_time(300, 0)
    assert offered_load(trace, cost, "trace") == pytest.approx(work / 10.0)
    assert offered_load(trace, cost, "burst") == math.inf
    assert math.isnan(offered_load(trace, cost, "closed-loop:4"))


def _whole_block_trace(tmp_path, block: int, seed: int):
    """A Mooncake-format chat trace whose prompts and answers end on block boundaries (an
    answer of 1 + j * block tokens: the prefill's token, then j whole blocks)."""
    from radixserve.sim.traces import read_mooncake, write_mooncake
    from radixserve.sim.workloads import mooncake_conversation

    records = mooncake_conversation(num_sessions=300, block_size=block, seed=seed)
    rng = np.random.default_rng(seed)
    for record in records:
        record["input_length"] = block * len(record["hash_ids"])
        record["output_length"] = 1 + block * int(rng.integers(1, 4))
    path = tmp_path / f"trace-{seed}.jsonl"
    write_mooncake(path, records)
    return read_mooncake(path, block, block_keys=True), read_mooncake(path, block)


@pytest.mark.parametrize("seed", [1, 2])
def test_block_level_replay_matches_token_level_at_page_size_block(tmp_path, seed):
    block = 16
    blocks, tokens = _whole_block_trace(tmp_path, block, seed)
    assert sum(len(r.input_ids) for r in tokens) == block * sum(len(r.input_ids) for r in blocks)
    for eviction in ("lru", "fifo"):
        for size in (200, 600):
            by_block = replay(blocks, ReplayConfig(eviction_policy=eviction, kv_cache_tokens=size))
            by_token = replay(
                tokens,
                ReplayConfig(
                    eviction_policy=eviction, kv_cache_tokens=block * size, page_size=block
                ),
            )
            assert by_block.token_hit_rate == pytest.approx(by_token.token_hit_rate, abs=0.005)
            assert by_block.failed == by_token.failed == 0
            # the answers' real tokens, and the time they take, not their keys
            assert by_block.output_tokens == by_token.output_tokens
            assert by_block.makespan == pytest.approx(by_token.makespan, rel=1e-3)


def test_block_keys_change_only_decode_timing(tmp_path):
    """With free decode, a block-sized decode step takes no longer than a token's, and every
    policy, adaptive ones included, gets the token-level hit rate exactly: what differs with
    a real decode cost is when requests are admitted, not what the cache holds."""
    block = 16
    blocks, tokens = _whole_block_trace(tmp_path, block, seed=4)
    free = CostModel(decode_step=0.0, decode_per_request=0.0, decode_per_context_token=0.0)
    for eviction in ("lfu", "wgd", "slru"):
        for size in (200, 300):
            by_block = replay(
                blocks,
                ReplayConfig(eviction_policy=eviction, kv_cache_tokens=size, cost_model=free),
            )
            by_token = replay(
                tokens,
                ReplayConfig(
                    eviction_policy=eviction,
                    kv_cache_tokens=block * size,
                    page_size=block,
                    cost_model=free,
                ),
            )
            assert by_block.token_hit_rate == by_token.token_hit_rate


def test_a_block_key_decode_step_costs_the_tokens_its_key_holds():
    from radixserve.sim.traces import answer_keys

    assert [answer_keys(n, 8) for n in (0, 1, 2, 9, 10, 17)] == [0, 1, 2, 2, 3, 3]
    block, answer = 8, 10  # keys: the prefill's token, then 8 tokens, then 1
    trace = [
        TraceRequest(
            "a",
            0.0,
            np.arange(3, dtype=np.int32),
            answer_keys(answer, block),
            key_tokens=block,
            answer_tokens=answer,
        )
    ]
    cost = CostModel(decode_per_request=0.0, decode_per_context_token=0.0)
    result = replay(trace, ReplayConfig(kv_cache_tokens=64, cost_model=cost))
    prefill = cost.prefill_batch_overhead + cost.prefill_time(3 * block, 0)
    assert result.makespan == pytest.approx(prefill + (answer - 1) * cost.decode_step)
    assert result.output_tokens == answer
    assert result.prompt_tokens == 3  # counts stay in blocks


def test_offered_load_adds_decode_at_the_batch_the_pool_holds():
    from radixserve.sim.replay import offered_load

    cost = CostModel(decode_per_request=0.0, decode_per_context_token=0.0)
    trace = [
        TraceRequest("a", 0.0, np.arange(100, dtype=np.int32), 50),
        TraceRequest("b", 10.0, np.arange(100, dtype=np.int32), 50),
    ]
    prefill = offered_load(trace, cost, "trace")
    # a pool of 150 tokens holds one request of 150: 100 decode steps one at a time
    one = offered_load(trace, cost, "trace", pool_keys=150)
    assert one == pytest.approx(prefill + 100 * cost.decode_step / 10.0)
    # a pool of 3,000 holds 20, but at most 2 may run: the steps are shared by two
    two = offered_load(trace, cost, "trace", pool_keys=3000, max_running_requests=2)
    assert two == pytest.approx(prefill + 50 * cost.decode_step / 10.0)


def test_peak_load_reads_the_busiest_window_of_the_span():
    from radixserve.sim.replay import offered_load

    cost = CostModel()
    prompt = np.arange(100, dtype=np.int32)
    # nine requests in the first tenth of 100 s, one at the end
    trace = [TraceRequest(f"r{i}", float(i), prompt, 1) for i in range(9)]
    trace.append(TraceRequest("late", 100.0, prompt, 1))
    one = cost.prefill_time(100, 0)
    assert offered_load(trace, cost, "trace") == pytest.approx(10 * one / 100.0)
    assert offered_load(trace, cost, "trace", windows=10) == pytest.approx(9 * one / 10.0)
