"""`radixserve replay`: the table, the files and the errors."""

from __future__ import annotations

import csv
import json

import pytest

from radixserve.cli import main, parse_cache_sizes
from radixserve.errors import InvalidArgumentError
from radixserve.sim.traces import write_token_jsonl
from radixserve.sim.workloads import make_workload


def test_replay_writes_table_csv_json_and_png(tmp_path, capsys):
    trace_path = tmp_path / "trace.jsonl"
    write_token_jsonl(
        trace_path,
        make_workload("few-shot", num_subjects=3, questions_per_subject=4, example_len=16),
    )
    out = tmp_path / "out"
    code = main(
        [
            "replay",
            str(trace_path),
            "--eviction",
            "lru,belady",
            "--schedule",
            "fcfs,lpm",
            "--cache",
            "5%,50%",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    header, _rule, *rows = [line for line in table.splitlines() if line.startswith("|")]
    assert header.split("|")[5].strip() == "hit rate %", "the first percentage column"
    assert len(rows) == 2 * 2 * 2
    assert "Infinite-cache bound" in table
    with (out / "replay.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 8
    payload = json.loads((out / "replay.json").read_text())
    assert len(payload["results"]) == 8 and 0 < payload["infinite_cache_bound"] < 1
    png = (out / "hit_rate.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_replay_of_a_named_workload(capsys):
    assert main(["replay", "workload:agent", "--cache", "20%"]) == 0
    assert "| lru | fcfs |" in capsys.readouterr().out


def test_cache_sizes_parse_and_bad_ones_exit_2(capsys):
    assert parse_cache_sizes("1%, 5%,4096") == [
        ("fraction", 1.0),
        ("fraction", 5.0),
        ("tokens", 4096),
    ]
    with pytest.raises(InvalidArgumentError):
        parse_cache_sizes("lots")
    with pytest.raises(SystemExit) as exc:
        main(["replay", "workload:agent", "--cache", "lots"])
    assert exc.value.code == 2
    assert "--cache" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["replay", "/nonexistent/trace.jsonl"])
    assert exc.value.code == 2


def test_cost_constants_are_settable_by_name():
    from radixserve.cli import parse_cost_model

    assert parse_cost_model("decode_step=0.5").decode_step == 0.5
    with pytest.raises(InvalidArgumentError, match="unknown constant"):
        parse_cost_model("speed=3")
    with pytest.raises(InvalidArgumentError, match="needs a number"):
        parse_cost_model("decode_step=fast")


def test_workload_args_reach_the_generator_and_bad_ones_exit_2(capsys):
    assert main(["replay", "workload:agent", "--workload-args", "num_agents=2,steps=2"]) == 0
    assert "| lru | fcfs |" in capsys.readouterr().out
    for bad in ("num_agents", "no_such_arg=3", "num_agents=0", "seed=3"):
        with pytest.raises(SystemExit) as exc:
            main(["replay", "workload:agent", "--workload-args", bad])
        assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["replay", "trace.jsonl", "--workload-args", "num_agents=2"])
    assert "workload" in capsys.readouterr().err


def test_replay_on_replicas_prints_every_router_and_writes_the_sweep(tmp_path, capsys):
    out = tmp_path / "cluster"
    args = ["replay", "workload:multi-turn-random", "--workload-args", "num_sessions=12,turns=3"]
    assert main([*args, "--replicas", "2", "--cache", "4000", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == [
        "round_robin",
        "pow2",
        "cache_aware",
        "precise",
        "one server, 2x the pool",
        "pure cache, 2x the pool (bound)",
    ]
    payload = json.loads((out / "cluster.json").read_text())
    assert sorted({r["replicas"] for r in payload["replica_sweep"]}) == [1, 2, 4, 8]
    assert (out / "replicas.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(SystemExit) as exc:
        main([*args, "--replicas", "2", "--router", "nearest"])
    assert exc.value.code == 2


def test_serve_replicas_refuses_a_single_server_events_endpoint(capsys):
    pytest.importorskip("ray.serve", reason="needs the ray extra")
    argv = ["serve", "--replicas", "2", "--kv-events-endpoint", "tcp://127.0.0.1:5999"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "each replica publishes" in capsys.readouterr().err


def test_serve_replicas_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--replicas", "0"])
    assert exit_info.value.code == 2
    assert "--replicas: must be >= 1" in capsys.readouterr().err


def test_serve_replicas_without_ray_names_the_install_command(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    monkeypatch.delitem(sys.modules, "radixserve.router.ray_serve", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--replicas", "2"])
    assert exit_info.value.code == 2
    assert "pip install 'radixserve[ray]'" in capsys.readouterr().err


def test_every_subcommands_help_prints(capsys):
    """Regression: a bare % in a help string made `radixserve study --help` raise."""
    from radixserve.cli import build_parser

    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command" or a.choices)
    for name in subcommands.choices:
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0, name
        assert "usage: radixserve" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bad",
    [
        ["--seed", "-3"],
        ["--cache", "abc"],
        ["--policy", "nope"],
        ["--eviction", "lfu,adaptive"],
    ],
)
def test_study_refuses_bad_arguments_before_simulating(bad, tmp_path, capsys):
    """Regression: a negative seed or a size that is not a number came out as a traceback, and
    a judged policy the study does not run was found out only after every cell had run."""
    with pytest.raises(SystemExit) as exit_info:
        main(["study", "--workloads", "agent", "--scale", "0.01", "--out", str(tmp_path), *bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["serve", "router"])
@pytest.mark.parametrize("port", ["70000", "0", "http"])
def test_a_port_out_of_range_is_refused_before_anything_loads(command, port, capsys):
    """Regression: `serve --port 70000` loaded the model, then died in bind() with a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--port", port])
    assert exit_info.value.code == 2
    assert "argument --port" in capsys.readouterr().err


def test_serve_refuses_a_port_in_use_before_loading_the_model(capsys):
    """Regression: the model loaded, then uvicorn's bind failed with a traceback and exit 3."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--host", "127.0.0.1", "--port", str(port), "--model", "/nonexistent"])
    assert exit_info.value.code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_serve_and_the_engine_evict_by_adaptive_unless_told_otherwise():
    """`adaptive` is the recommended policy (docs/eviction.md), so it is what a server started
    without `--eviction-policy` runs; `--eviction-policy lru` still gives SGLang's default."""
    from radixserve.cli import _engine_options, build_parser
    from radixserve.config import EngineConfig

    parser = build_parser()
    assert _engine_options(parser.parse_args(["serve"]))["eviction_policy"] == "adaptive"
    assert EngineConfig().eviction_policy == "adaptive"
    chosen = parser.parse_args(["serve", "--eviction-policy", "lru"])
    assert (
        EngineConfig(eviction_policy=_engine_options(chosen)["eviction_policy"]).eviction_policy
        == "lru"
    )
