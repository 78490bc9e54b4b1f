"""Trace readers: Mooncake JSONL and radixserve's token JSONL."""

from __future__ import annotations

import json

import numpy as np
import pytest

from radixserve.errors import InvalidArgumentError
from radixserve.sim.replay import ReplayConfig, replay
from radixserve.sim.traces import (
    TraceRequest,
    load_trace,
    read_mooncake,
    read_token_jsonl,
    write_token_jsonl,
)


def write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


MOONCAKE = [
    {"timestamp": 0, "input_length": 8, "output_length": 2, "hash_ids": [1, 2]},
    {"timestamp": 10, "input_length": 10, "output_length": 2, "hash_ids": [1, 2, 3]},
    {"timestamp": 20, "input_length": 6, "output_length": 2, "hash_ids": [1, 5]},
]


def test_mooncake_blocks_become_distinct_token_runs(tmp_path):
    trace = read_mooncake(write_lines(tmp_path / "t.jsonl", MOONCAKE), block_size=4)
    assert [r.arrival for r in trace] == [0.0, 0.01, 0.02]
    assert trace[0].input_ids.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert trace[1].input_ids.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert trace[2].input_ids.tolist() == [4, 5, 6, 7, 20, 21]
    assert [r.output_len for r in trace] == [2, 2, 2]


def test_mooncake_replay_reproduces_the_hand_computed_hit_rate(tmp_path):
    # Request 2 reuses blocks 1-2 (8 tokens), request 3 block 1 (4 tokens): 12 of 24 tokens.
    trace = load_trace(write_lines(tmp_path / "t.jsonl", MOONCAKE), block_size=4)
    result = replay(trace, ReplayConfig(kv_cache_tokens=1000, check_invariants=True))
    assert result.token_hit_rate == pytest.approx(12 / 24)
    assert result.prefill_tokens_computed == 24 - 12
    assert result.failed == 0


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {"timestamp": 9, "input_length": 9, "output_length": 1, "hash_ids": [1, 2]},
            "hash_ids has 2 blocks but input_length 9 needs 3 blocks of 4",
        ),
        (
            {"timestamp": 9, "input_length": 4, "output_length": 1, "hash_ids": [1, 2]},
            "hash_ids has 2 blocks but input_length 4 needs 1 blocks",
        ),
        (
            {"timestamp": -5, "input_length": 1, "output_length": 1, "hash_ids": [1]},
            "timestamp -5 ms is before line 1's 0 ms",
        ),
        ({"timestamp": "x", "input_length": 1, "output_length": 1, "hash_ids": [1]}, "timestamp"),
        ({"timestamp": 0, "input_length": 1, "output_length": -1, "hash_ids": [1]}, "output"),
        ({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [-1]}, "hash_ids"),
    ],
)
def test_mooncake_errors_name_the_line_and_field(tmp_path, record, message):
    path = write_lines(tmp_path / "t.jsonl", [MOONCAKE[0], record])
    with pytest.raises(InvalidArgumentError, match=f"t.jsonl:2: .*{message}"):
        read_mooncake(path, block_size=4)


def test_an_empty_trace_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(InvalidArgumentError, match=r"empty\.jsonl: the trace holds no requests"):
        load_trace(path)
    path.write_text('{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(InvalidArgumentError, match=r"no requests \(1 bad lines skipped\)"):
        read_mooncake(path, 4, skipped=[])


def test_bad_lines_can_be_skipped_and_are_counted(tmp_path, capsys):
    from radixserve.cli import main

    lines = [
        json.dumps(MOONCAKE[0]),
        "{not json",
        json.dumps({**MOONCAKE[1], "hash_ids": [1]}),
        json.dumps({**MOONCAKE[1], "timestamp": -1}),
        "[1, 2]",
        json.dumps(MOONCAKE[2]),
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InvalidArgumentError, match=r"t\.jsonl:2: not JSON"):
        read_mooncake(path, 4)
    skipped: list[str] = []
    trace = read_mooncake(path, 4, skipped=skipped)
    assert [r.arrival for r in trace] == [0.0, 0.02]
    assert [m.split(": ", 1)[0].rsplit(":", 1)[1] for m in skipped] == ["2", "3", "4", "5"]
    argv = ["replay", str(path), "--block-size", "4", "--cache-only", "--cache", "100"]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2, "the CLI refuses the first bad line, without a traceback"
    assert "t.jsonl:2: not JSON" in capsys.readouterr().err
    assert main([*argv, "--skip-bad-lines"]) == 0
    assert "skipped 4 bad lines" in capsys.readouterr().out


def test_malformed_json_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_ids": [1]}\n{not json}\n')
    with pytest.raises(InvalidArgumentError, match=r"bad\.jsonl:2: not JSON"):
        load_trace(path)
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        load_trace(tmp_path / "missing.jsonl")


def test_token_jsonl_round_trips(tmp_path):
    trace = [
        TraceRequest("a", 0.5, np.array([1, 2, 3], np.int32), 2, np.array([7, 8], np.int32)),
        TraceRequest("b", 1.0, np.array([1, 2, 3, 7, 8, 4], np.int32), 5, priority=2, after="a"),
    ]
    path = tmp_path / "t.jsonl"
    write_token_jsonl(path, trace)
    back = load_trace(path)
    assert [r.rid for r in back] == ["a", "b"]
    assert back[0].output_ids.tolist() == [7, 8] and back[1].output_ids is None
    assert back[1].after == "a" and back[1].priority == 2 and back[1].output_len == 5
    assert back[1].input_ids.tolist() == [1, 2, 3, 7, 8, 4]


@pytest.mark.parametrize(
    "record",
    [
        {"input_ids": []},
        {"input_ids": [1.5]},
        {"input_ids": [1], "output_len": -2},
        {"input_ids": [1], "arrival": -1},
        {"input_ids": [1], "after": 3},
    ],
)
def test_token_jsonl_rejects_bad_fields(tmp_path, record):
    with pytest.raises(InvalidArgumentError, match=r"t\.jsonl:1"):
        read_token_jsonl(write_lines(tmp_path / "t.jsonl", [record]))


def test_a_mooncake_replay_runs_block_keys_by_default(tmp_path, capsys):
    from radixserve.cli import main

    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MOONCAKE))
    assert main(["replay", str(path), "--block-size", "4", "--cache", "100"]) == 0
    by_block = capsys.readouterr().out
    assert "| cache blocks |" in by_block
    assert (
        main(["replay", str(path), "--block-size", "4", "--cache", "100", "--keys", "tokens"]) == 0
    )
    assert "| cache tokens |" in capsys.readouterr().out
