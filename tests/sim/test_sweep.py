"""Sweeps: parallel cells give the serial results, and a journalled sweep resumes."""

from __future__ import annotations

import json

import pytest

from radixserve.cli import main
from radixserve.errors import InvalidArgumentError
from radixserve.sim.sweep import read_journal, run_grid


def _square(cell: dict) -> dict:
    return {"value": cell["x"] ** 2}


def test_a_journalled_grid_resumes_without_redoing_cells(tmp_path):
    journal = tmp_path / "cells.jsonl"
    cells = [{"x": i} for i in range(6)]
    seen: list[int] = []
    first = run_grid(
        cells[:4], _square, journal=journal, on_result=lambda c, r: seen.append(c["x"])
    )
    assert first == [{"value": i * i} for i in range(4)] and seen == [0, 1, 2, 3]
    with journal.open("a") as handle:
        handle.write('{"cell": {"x": 5}, "res')  # a sweep killed mid-write
    seen.clear()
    again = run_grid(cells, _square, journal=journal, on_result=lambda c, r: seen.append(c["x"]))
    assert again == [{"value": i * i} for i in range(6)]
    assert seen == [4, 5], "only the cells missing from the journal run"
    assert len(read_journal(journal)) == 6
    with pytest.raises(InvalidArgumentError):
        run_grid(cells, _square, jobs=0)


def test_parallel_cells_match_serial_ones_and_the_cli_resumes(tmp_path, capsys):
    argv = [
        "replay", "workload:shared-prefix", "--workload-args",
        "num_groups=6,prompts_per_group=5,system_len=64", "--eviction", "lru,lfu",
        "--schedule", "fcfs,lpm", "--cache", "5%,20%", "--arrivals", "burst",
    ]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "serial")]) == 0
    serial = capsys.readouterr().out
    assert main([*argv, "--out", str(tmp_path / "parallel"), "--jobs", "2"]) == 0
    parallel = capsys.readouterr().out

    def hit_rates(text: str) -> list[str]:
        return [line.split("|")[5] for line in text.splitlines() if line.startswith("| l")]

    assert len(hit_rates(serial)) == 8 and hit_rates(serial) == hit_rates(parallel)
    journal = tmp_path / "parallel" / "cells.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:3]) + "\n")  # as if killed after three cells
    assert main([*argv, "--out", str(tmp_path / "parallel"), "--jobs", "2"]) == 0
    assert hit_rates(capsys.readouterr().out) == hit_rates(serial)
    assert len(journal.read_text().splitlines()) == 8
    cells = [json.loads(line)["cell"] for line in journal.read_text().splitlines()]
    assert all(c["trace"]["trace"] == "workload:shared-prefix" for c in cells)


def test_the_grid_runs_as_ray_tasks_on_a_local_cluster(tmp_path, capsys):
    """`--ray local` starts a Ray cluster in this process, runs the cells as tasks, journals
    them and stops it; the table equals the serial one."""
    pytest.importorskip("ray", reason="--ray needs the ray extra")
    argv = [
        "replay", "workload:shared-prefix", "--workload-args",
        "num_groups=4,prompts_per_group=4,system_len=32", "--eviction", "lru,lfu",
        "--cache", "5%,20%", "--arrivals", "burst",
    ]  # fmt: skip
    assert main(argv) == 0
    serial = capsys.readouterr().out
    assert main([*argv, "--ray", "local", "--out", str(tmp_path)]) == 0
    on_ray = capsys.readouterr().out

    def rows(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("| l")]

    def hit_rates(text: str) -> list[str]:
        return [line.split("|")[5] for line in rows(text)]

    assert len(rows(serial)) == 4 and hit_rates(on_ray) == hit_rates(serial)
    assert len((tmp_path / "cells.jsonl").read_text().splitlines()) == 4
