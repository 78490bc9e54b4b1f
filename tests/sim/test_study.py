"""The eviction study: a small-scale run has the structure of the full one, and its sums add up."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from radixserve.cli import main
from radixserve.errors import InvalidArgumentError
from radixserve.sim.cacheonly import simulate_cache
from radixserve.sim.study import (
    BEGIN,
    END,
    STUDY_WORKLOADS,
    StudyRow,
    mean_gap_closed,
    replay_command,
    run_study,
    study_trace,
    summarize,
    write_report,
)
from radixserve.sim.traces import read_mooncake, write_mooncake
from radixserve.sim.workloads import mooncake_conversation

SCALE = 0.02
WORKLOADS = ("shared-prefix-zipf", "tree-of-thought-shuffled", "chat-documents")
POLICIES = ("lru", "lfu", "adaptive", "belady")
SIZES = (1.0, 5.0)


@pytest.fixture(scope="module")
def rows() -> list[StudyRow]:
    return run_study(WORKLOADS, POLICIES, SIZES, scale=SCALE, jobs=1)


def test_every_cell_is_a_replay_of_the_study_trace(rows):
    assert [(r.workload, r.policy, r.size_percent) for r in rows] == [
        (w, p, s) for w in WORKLOADS for p in POLICIES for s in SIZES
    ]
    first = rows[0]
    again = simulate_cache(study_trace(first.workload, SCALE), first.policy, cache_fraction=1.0)
    assert again.hit_rate == first.hit_rate, "deterministic, and the same code"
    assert {r.unit for r in rows if r.workload == "chat-documents"} == {"blocks"}
    assert {r.unit for r in rows if r.workload != "chat-documents"} == {"tokens"}
    for r in rows:
        assert 0 <= r.hit_rate <= r.infinite_bound + 1e-9
        assert r.kv_tokens >= round(r.size_percent / 100 * r.unique_tokens)


def test_report_has_a_summary_a_table_and_a_png_per_workload(rows, tmp_path):
    md = tmp_path / "eviction.md"
    md.write_text(f"# Prose\n\nkept\n\n{BEGIN}\nold figures\n{END}\n\nkept too\n")
    assert write_report(tmp_path / "eviction", rows, markdown=md, scale=SCALE) == md
    text = md.read_text()
    assert text.startswith("# Prose") and "kept too" in text and "old figures" not in text
    assert "Mean gap closed" in text and "Worst case against LRU" in text
    assert "Worst case against the better of LRU and LFU" in text
    for w in WORKLOADS:
        png = tmp_path / "eviction" / f"{w}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"![{w}](eviction/{w}.png)" in text
        table = text.split(f"### {w}\n", 1)[1].split("![", 1)[0]
        body = [
            line for line in table.splitlines() if line[:3].startswith("| ") and line[2].isdigit()
        ]
        assert len(body) == len(SIZES)
        assert all(len(line.split("|")) == len(POLICIES) + 7 for line in body)
        assert "adaptive: gap closed" in table and "adaptive - best of lru, lfu" in table
    data = json.loads((tmp_path / "eviction" / "study.json").read_text())
    assert len(data) == len(rows) and data[0]["workload"] == WORKLOADS[0]
    write_report(tmp_path / "eviction", rows, markdown=md, scale=SCALE)
    assert md.read_text().count(BEGIN) == 1, "regenerating replaces, never appends"


def _row(workload: str, policy: str, size: float, hit: float) -> StudyRow:
    return StudyRow(workload, policy, size, 100, hit / 100, 0.62, 1000, 10, 0, 0.0)


def test_summary_arithmetic():
    rows = [
        _row("w", "lru", 1, 10), _row("w", "wgd", 1, 14), _row("w", "belady", 1, 20),
        _row("w", "lfu", 1, 15),
        _row("w", "lru", 5, 30), _row("w", "wgd", 5, 32), _row("w", "belady", 5, 40),
        _row("w", "lfu", 5, 20),
        _row("w", "lru", 20, 60), _row("w", "wgd", 20, 59.5), _row("w", "belady", 20, 60),
        _row("w", "lfu", 20, 50),
        _row("flat", "lru", 1, 50), _row("flat", "wgd", 1, 50), _row("flat", "belady", 1, 50.2),
    ]  # fmt: skip
    w, flat = summarize(rows, "wgd")
    assert w.gap_closed == pytest.approx((4 + 2) / (10 + 10))
    assert (w.gap_points, w.worst_vs_lru, w.worst_size) == (pytest.approx(20), -0.5, 20)
    assert w.worst_vs_classical == pytest.approx(-1) and w.worst_classical_size == 1, "LFU led"
    assert w.lru_knee == 20, "LRU first reaches 95% of the 62% bound at 20%"
    assert flat.gap_closed is None, "a 0.2-point gap is noise, not a ratio"
    assert mean_gap_closed([w, flat]) == pytest.approx(0.3)
    assert math.isnan(mean_gap_closed([flat]))


def test_replay_command_reproduces_a_cell(rows, capsys):
    row = next(
        r for r in rows if r.workload == "tree-of-thought-shuffled" and r.policy == "adaptive"
    )
    command = replay_command(row.workload, row.policy, row.size_percent, scale=SCALE)
    argv = command.split()[1:]
    assert main(argv) == 0
    table = capsys.readouterr().out
    line = next(line for line in table.splitlines() if line.startswith("| adaptive"))
    hit = float(line.split("|")[4])
    assert hit == pytest.approx(100 * row.hit_rate, abs=0.005)


def test_study_cli_writes_the_report(tmp_path, capsys):
    out = tmp_path / "docs" / "eviction"
    code = main(
        [
            "study", "--out", str(out), "--scale", "0.01", "--cache", "2",
            "--workloads", "few-shot", "--eviction", "lru,lfu,adaptive,belady",
        ]
    )  # fmt: skip
    assert code == 0
    assert "mean gap closed by adaptive" in capsys.readouterr().out
    assert (tmp_path / "docs" / "eviction.md").is_file() and (out / "few-shot.png").is_file()
    journal = out / "cells.jsonl"
    assert len(journal.read_text().splitlines()) == 4
    kept = json.loads(journal.read_text().splitlines()[0])
    kept["result"]["hit_rate"] = 0.123456  # a mark only a resumed run can carry over
    journal.write_text(json.dumps(kept) + "\n")
    argv = ["study", "--out", str(out), "--scale", "0.01", "--cache", "2", "--workloads",
            "few-shot", "--eviction", "lru,lfu,adaptive,belady"]  # fmt: skip
    assert main([*argv, "--resume"]) == 0
    lines = journal.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["result"]["hit_rate"] == 0.123456
    assert main(argv) == 0  # without --resume the journal starts afresh
    assert "0.123456" not in journal.read_text()


def test_bad_study_arguments_are_refused():
    with pytest.raises(InvalidArgumentError):
        run_study(["no-such-workload"])
    with pytest.raises(InvalidArgumentError):
        run_study(["agent"], scale=0)
    with pytest.raises(InvalidArgumentError):
        run_study(["agent"], jobs=0)


def test_every_study_workload_builds_at_small_scale():
    for name in STUDY_WORKLOADS:
        trace = study_trace(name, 0.01)
        assert len(trace) >= 2 and all(len(r.input_ids) for r in trace)


def test_mooncake_conversation_round_trips_and_shares_like_chat(tmp_path):
    records = mooncake_conversation(num_sessions=30, num_apps=3, seed=1)
    path = tmp_path / "trace.jsonl"
    write_mooncake(path, records)
    trace = read_mooncake(path, 16)
    assert len(trace) == len(records)
    assert [r["timestamp"] for r in records] == sorted(r["timestamp"] for r in records)
    for r, rec in zip(trace, records, strict=True):
        assert len(r.input_ids) == rec["input_length"] <= 16 * len(rec["hash_ids"])
    heads = {tuple(rec["hash_ids"][:4]) for rec in records}
    assert len(heads) <= 3, "every session starts with one of the apps' system prompts"
    # A later turn extends an earlier prompt of its session block for block.
    ids = [rec["hash_ids"] for rec in records]
    assert any(b[: len(a)] == a and len(b) > len(a) for a in ids for b in ids)
    assert mooncake_conversation(num_sessions=5, seed=2) == mooncake_conversation(
        num_sessions=5, seed=2
    )
    with pytest.raises(InvalidArgumentError):
        mooncake_conversation(turn_blocks=(3, 1))
    assert np.all(np.diff([r.arrival for r in trace]) >= 0)


def test_an_interrupted_study_resumes_from_its_journal(rows, tmp_path):
    """Cells already in the journal are read back, not simulated again, and rows agree."""
    journal = tmp_path / "cells.jsonl"
    simulated = []
    first = run_study(
        WORKLOADS[:1], POLICIES, SIZES, scale=SCALE, journal=journal, progress=simulated.append
    )
    assert len(simulated) == len(first) == len(POLICIES) * len(SIZES)
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:3]) + "\n")  # as if killed after three cells
    simulated.clear()
    again = run_study(
        WORKLOADS[:1], POLICIES, SIZES, scale=SCALE, journal=journal, progress=simulated.append
    )
    assert len(simulated) == len(first) - 3
    strip = lambda r: {**r.__dict__, "wall_seconds": 0}  # noqa: E731
    assert [strip(r) for r in again] == [strip(r) for r in first]
    assert [strip(r) for r in again] == [strip(r) for r in rows[: len(first)]]
