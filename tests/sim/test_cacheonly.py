"""Pure cache simulation: exact hit counting, block keys, and the CLI's --cache-only mode."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.cli import main
from radixserve.errors import InvalidArgumentError
from radixserve.sim.cacheonly import simulate_cache
from radixserve.sim.oracle import unique_tokens
from radixserve.sim.traces import TraceRequest, read_mooncake, write_mooncake
from radixserve.sim.workloads import chat_traffic, make_workload


def _trace(prompts) -> list[TraceRequest]:
    return [
        TraceRequest(f"r{i}", float(i), np.asarray(p, dtype=np.int32), 4)
        for i, p in enumerate(prompts)
    ]


def test_hits_are_counted_exactly_under_lru():
    a, b, c = list(range(10)), list(range(100, 110)), list(range(200, 210))
    trace = _trace([a, [*a, 1, 2], b, a, c, b])
    result = simulate_cache(trace, "lru", kv_tokens=20, check_invariants=True)
    assert result.prompt_tokens == 10 + 12 + 10 + 10 + 10 + 10
    # r1 reuses a; r2 (b) evicts the leaf [1, 2]; r3 reuses a; r4 (c) evicts b, used before a;
    # r5 (b) misses and evicts a.
    assert result.hit_tokens == 10 + 10
    assert result.evicted_tokens == 2 + 10 + 10


def test_the_largest_request_always_fits():
    trace = _trace([list(range(50)), list(range(50))])
    result = simulate_cache(trace, "lru", kv_tokens=4)
    assert result.kv_tokens_requested == 4 and result.kv_tokens == 50
    assert result.hit_tokens == 50


@pytest.mark.parametrize("policy", ["lru", "lfu", "slru", "wgd", "adaptive", "belady"])
def test_every_policy_keeps_the_invariants(policy):
    trace = make_workload("multi-turn-random", num_sessions=12, turns=4, system_len=32, seed=0)
    result = simulate_cache(trace, policy, cache_fraction=10, check_invariants=True)
    assert result.requests == len(trace) and result.evicted_tokens > 0
    assert 0 <= result.hit_rate <= 1


def test_belady_is_an_upper_reference_for_the_online_policies():
    trace = make_workload("shared-prefix", num_groups=12, prompts_per_group=6, system_len=64)
    unique = unique_tokens(trace)
    rates = {
        p: simulate_cache(trace, p, cache_fraction=5, unique=unique).hit_rate
        for p in ("lru", "lfu", "belady")
    }
    assert rates["belady"] >= max(rates["lru"], rates["lfu"])


def test_block_keys_give_the_token_level_hit_rate_when_blocks_are_whole(tmp_path):
    records = chat_traffic(num_sessions=120, num_apps=5, block_size=8, seed=3)
    for record in records:  # whole blocks only: no partial last block
        record["input_length"] = 8 * len(record["hash_ids"])
    path = tmp_path / "trace.jsonl"
    write_mooncake(path, records)
    blocks = read_mooncake(path, 8, block_keys=True)
    tokens = read_mooncake(path, 8)
    assert [len(r.input_ids) for r in blocks] == [len(rec["hash_ids"]) for rec in records]
    for size_blocks in (40, 200):
        by_block = simulate_cache(blocks, "lru", kv_tokens=size_blocks)
        by_token = simulate_cache(tokens, "lru", kv_tokens=8 * size_blocks, page_size=8)
        assert by_block.hit_rate == pytest.approx(by_token.hit_rate, abs=1e-12)
        assert 8 * by_block.evicted_tokens == by_token.evicted_tokens


def test_a_partial_last_block_counts_whole_with_block_keys(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_mooncake(
        path,
        [
            {"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [4, 5]},
            {"timestamp": 1, "input_length": 16, "output_length": 1, "hash_ids": [4, 5]},
        ],
    )
    blocks = read_mooncake(path, 8, block_keys=True)
    assert [r.input_ids.tolist() for r in blocks] == [[4, 5], [4, 5]]
    assert simulate_cache(blocks, "lru", kv_tokens=10).hit_rate == 0.5
    tokens = read_mooncake(path, 8)
    # Token level at page 8: only the first page was whole in request 0, so 8 of 25 tokens hit.
    assert simulate_cache(tokens, "lru", kv_tokens=80, page_size=8).hit_tokens == 8


def test_bad_capacities_are_refused():
    trace = _trace([[1, 2, 3]])
    for kwargs in (dict(), dict(kv_tokens=4, cache_fraction=5), dict(kv_tokens=0)):
        with pytest.raises(InvalidArgumentError):
            simulate_cache(trace, "lru", **kwargs)
    with pytest.raises(InvalidArgumentError):
        simulate_cache([], "lru", kv_tokens=4)
    with pytest.raises(InvalidArgumentError):
        simulate_cache(trace, "no-such-policy", kv_tokens=4)
    for page_size in (0, -4):  # regression: 0 raised ZeroDivisionError sizing the pool
        with pytest.raises(InvalidArgumentError, match="page_size"):
            simulate_cache(trace, "lru", kv_tokens=4, page_size=page_size)


def test_the_cli_runs_a_mooncake_trace_by_blocks(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    write_mooncake(path, chat_traffic(num_sessions=60, num_apps=4, seed=1))
    out = tmp_path / "out"
    argv = ["replay", str(path), "--cache-only", "--eviction", "lru,adaptive,belady"]
    assert main([*argv, "--cache", "5%,20%", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "unique blocks, no scheduler" in text and "| cache blocks |" in text
    rows = [line for line in text.splitlines() if line.startswith(("| lru", "| adapt", "| bel"))]
    assert len(rows) == 6
    assert (out / "cache_only.json").is_file()
    assert main([*argv, "--keys", "tokens", "--cache", "5%"]) == 0
    assert "unique tokens" in capsys.readouterr().out


def test_a_policy_that_reports_on_itself_has_its_account_in_the_result():
    from dataclasses import asdict

    from radixserve.cache.adaptive import AdaptivePolicy
    from radixserve.cache.evict import register_eviction_policy

    made: list[AdaptivePolicy] = []

    def factory() -> AdaptivePolicy:
        made.append(AdaptivePolicy(sample_pages=64))
        return made[-1]

    register_eviction_policy("adaptive-recorded", factory, replace=True)
    trace = make_workload("multi-turn-random", seed=3, num_sessions=64, turns=4)
    result = simulate_cache(trace, "adaptive-recorded", cache_fraction=5)
    summary = made[-1].summary()
    assert summary.epochs > 0 and summary.estimated_hit_rates
    assert result.policy_summary == asdict(summary)
    assert result.as_dict()["policy_summary"]["following"] == summary.following
    assert simulate_cache(trace, "lru", cache_fraction=5).policy_summary is None


def test_the_cli_prints_adaptive_s_account_for_each_of_its_rows(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    write_mooncake(path, chat_traffic(num_sessions=60, num_apps=4, seed=1))
    out = tmp_path / "out"
    argv = ["replay", str(path), "--cache-only", "--eviction", "lru,adaptive", "--out", str(out)]
    assert main([*argv, "--cache", "5%,20%"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("- ")]
    assert len(lines) == 2 and all(line.startswith("- adaptive at ") for line in lines)
    assert all("switches in" in line and "tree" in line for line in lines)
    import json

    rows = json.loads((out / "cache_only.json").read_text())["results"]
    assert [r["policy_summary"] is None for r in rows] == [True, True, False, False]


def test_a_host_tier_adds_hits_up_to_the_infinite_cache_bound():
    from radixserve.sim.oracle import infinite_cache

    trace = make_workload("multi-turn-random")
    bound, _ = infinite_cache(trace, 1)
    alone = simulate_cache(trace, "lru", kv_tokens=10_000)
    rates = [
        simulate_cache(trace, "lru", kv_tokens=10_000, host_tokens=h, check_invariants=True)
        for h in (5_000, 20_000, 10**7)
    ]
    assert alone.host_hit_rate == 0
    totals = [r.hit_rate for r in rates]
    assert alone.hit_rate < totals[0] <= totals[1] <= totals[2]
    assert all(r.host_hit_rate > 0 for r in rates)
    assert totals[2] == pytest.approx(bound)  # nothing is ever lost: every reuse hits


def test_a_host_tier_smaller_than_a_page_is_refused():
    with pytest.raises(InvalidArgumentError, match="at least one page"):
        simulate_cache(make_workload("multi-turn-random"), "lru", kv_tokens=10_000, host_tokens=8)


def test_replay_reports_host_tier_hits_apart(capsys):
    argv = ["replay", "workload:multi-turn-random", "--cache-only", "--cache", "10000"]
    assert main([*argv, "--host-cache", "20000"]) == 0
    out = capsys.readouterr().out
    assert "| host tokens | device hit % | host hit % |" in out
    assert "| 20,000 | 27.86 | 40.56 |" in out


def test_a_scheduled_replay_loads_from_the_host_tier_before_admission(capsys):
    from radixserve.sim.replay import ReplayConfig, replay

    trace = make_workload("multi-turn-random")
    base = dict(kv_cache_tokens=10_000, arrivals="closed-loop:8", check_invariants=True)
    alone = replay(trace, ReplayConfig(**base))
    tiered = replay(trace, ReplayConfig(**base, host_cache_tokens=20_000))
    assert alone.host_hit_rate == 0 < tiered.host_hit_rate <= tiered.token_hit_rate
    assert tiered.token_hit_rate > alone.token_hit_rate + 0.2
    assert tiered.ttft_p50 < alone.ttft_p50
    argv = ["replay", "workload:multi-turn-random", "--cache", "10000", "--host-cache", "20000"]
    assert main(argv) == 0
    assert "| host tokens | host hit % |" in capsys.readouterr().out


def test_a_storage_tier_behind_the_host_tier_counts_its_own_hits(capsys):
    """Storage is written through as requests end, so an unbounded one catches every reuse
    the host tier lost; the hits split across the three tiers and add up."""
    from radixserve.sim.oracle import infinite_cache

    trace = make_workload("multi-turn-random")
    bound, _ = infinite_cache(trace, 1)
    base = dict(kv_tokens=10_000, check_invariants=True)
    host = simulate_cache(trace, "lru", host_tokens=5_000, **base)
    both = simulate_cache(trace, "lru", host_tokens=5_000, storage_tokens=10**7, **base)
    small = simulate_cache(trace, "lru", host_tokens=5_000, storage_tokens=20_000, **base)
    assert host.storage_hit_rate == 0 < small.storage_hit_rate < both.storage_hit_rate
    assert both.hit_rate == pytest.approx(bound)
    assert both.host_hit_rate > 0 and both.hit_rate > both.host_hit_rate + both.storage_hit_rate
    argv = ["replay", "workload:multi-turn-random", "--cache-only", "--cache", "10000"]
    assert main([*argv, "--host-cache", "5000", "--storage-cache", "20000"]) == 0
    out = capsys.readouterr().out
    head = "| host tokens | storage tokens | device hit % | host hit % | storage hit % |"
    assert head in out


def test_a_scheduled_replay_charges_storage_loads_and_skips_those_slower_than_recomputing():
    from radixserve.sim.costmodel import CostModel
    from radixserve.sim.replay import ReplayConfig, replay

    trace = make_workload("multi-turn-random")
    base = dict(kv_cache_tokens=10_000, arrivals="closed-loop:8", storage_cache_tokens=10**6)

    def run(per_token: float, check: bool = False):
        cost = CostModel(storage_load_per_token=per_token)  # prefill: 6e-5 s a token
        return replay(trace, ReplayConfig(**base, cost_model=cost, check_invariants=check))

    cheap, dear, slower = run(2e-5, check=True), run(5e-5), run(2e-4)
    assert cheap.storage_hit_rate > 0.2 and cheap.host_hit_rate == 0
    assert dear.storage_hit_rate > 0.2 and dear.makespan > cheap.makespan
    assert slower.storage_hit_rate == 0  # the engine's rule: read only when it beats prefill


def test_the_host_tiers_eviction_policy_is_chosen_by_name():
    trace = make_workload("multi-turn-random")
    rates = {
        policy: simulate_cache(
            trace, "lru", kv_tokens=10_000, host_tokens=10_000, host_eviction_policy=policy
        ).host_hit_rate
        for policy in ("lru", "mru")
    }
    assert rates["lru"] != rates["mru"]
    with pytest.raises(InvalidArgumentError, match="eviction_policy must be one of"):
        simulate_cache(
            trace, "lru", kv_tokens=10_000, host_tokens=10_000, host_eviction_policy="nope"
        )
