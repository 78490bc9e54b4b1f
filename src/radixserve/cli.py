"""The `radixserve` command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from radixserve.errors import InvalidArgumentError

log = logging.getLogger("radixserve")


def _split(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def parse_cache_sizes(value: str) -> list[tuple[str, float]]:
    """'1%,5%,65536' -> [('fraction', 1.0), ('fraction', 5.0), ('tokens', 65536)]."""
    sizes: list[tuple[str, float]] = []
    for item in _split(value):
        try:
            if item.endswith("%"):
                sizes.append(("fraction", float(item[:-1])))
            else:
                sizes.append(("tokens", int(item)))
        except ValueError:
            raise InvalidArgumentError(
                f"--cache entries must be percentages like 5% or token counts, got {item!r}"
            ) from None
    if not sizes:
        raise InvalidArgumentError("--cache needs at least one size")
    return sizes


def parse_cost_model(value: str | None):
    """'decode_step=0.01,prefill_per_token=1e-4' -> a CostModel with those constants changed."""
    from dataclasses import fields

    from radixserve.sim.costmodel import CostModel

    if not value:
        return CostModel()
    names = {f.name for f in fields(CostModel)}
    changes = {}
    for item in _split(value):
        name, _, number = item.partition("=")
        if name not in names:
            raise InvalidArgumentError(f"--cost: unknown constant {name!r}; known: {sorted(names)}")
        try:
            changes[name] = float(number)
        except ValueError:
            raise InvalidArgumentError(f"--cost: {name} needs a number, got {number!r}") from None
    return CostModel(**changes)


def parse_workload_args(value: str | None) -> dict:
    """'num_groups=512,zipf=1.1' -> {'num_groups': 512, 'zipf': 1.1} (numbers stay numbers)."""
    import ast

    out: dict = {}
    for item in _split(value or ""):
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier():
            raise InvalidArgumentError(f"--workload-args entries must be name=value, got {item!r}")
        try:
            out[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[name] = text
    return out


def _load(
    trace: str,
    fmt: str,
    block_size: int,
    seed: int,
    workload_args: str | None = None,
    block_keys: bool = False,
    skip_bad_lines: bool = False,
):
    from radixserve.sim.study import workload_trace
    from radixserve.sim.traces import load_trace

    if trace.startswith("workload:"):
        kwargs = parse_workload_args(workload_args)
        if "seed" in kwargs:
            raise InvalidArgumentError("--workload-args: give the seed with --seed")
        try:
            return workload_trace(
                trace.split(":", 1)[1], seed=seed, block_keys=block_keys, **kwargs
            )
        except TypeError as exc:
            raise InvalidArgumentError(f"--workload-args: {exc}") from None
    if workload_args:
        raise InvalidArgumentError("--workload-args applies only to workload:NAME traces")
    skipped: list[str] | None = [] if skip_bad_lines else None
    requests = load_trace(
        trace, fmt=fmt, block_size=block_size, block_keys=block_keys, skipped=skipped
    )
    if skipped:
        log.warning("skipped %d bad lines of %s; the first: %s", len(skipped), trace, skipped[0])
        print(f"skipped {len(skipped)} bad lines (--skip-bad-lines); the first: {skipped[0]}")
    return requests


def cmd_replay(args: argparse.Namespace) -> int:
    from radixserve.sim.oracle import infinite_cache
    from radixserve.sim.replay import offered_load
    from radixserve.sim.report import markdown_table, plot_hit_rates, write_csv
    from radixserve.sim.traces import sniff_format

    keys = "tokens" if args.keys == "tokens" else "blocks"
    spec = {
        "trace": args.trace,
        "format": args.format,
        "block_size": args.block_size,
        "seed": args.seed,
        "workload_args": args.workload_args,
        "keys": keys,
        "skip_bad_lines": args.skip_bad_lines,
    }
    trace = _load_spec(spec)
    evictions = _split(args.eviction)
    sizes = parse_cache_sizes(args.cache)
    bound, unique = infinite_cache(trace, args.page_size if args.cache_only else 1)
    unit = "tokens"
    if keys == "blocks":
        from radixserve.sim.study import unit_of

        name = args.trace.split(":", 1)[1] if args.trace.startswith("workload:") else None
        if name is not None:
            unit = unit_of(name)
        elif args.format == "mooncake" or sniff_format(args.trace) == "mooncake":
            unit = "blocks"
    log.info("trace: %d requests, %d unique %s", len(trace), unique, unit)
    if args.replicas:
        return _cluster(args, trace, evictions, sizes, unique)
    cells = _grid(args, spec, evictions, sizes)
    results = _sweep(args, cells, trace, unique)
    if args.cache_only:
        return _cache_only(args, trace, results, bound, unique, unit)
    cost_model = parse_cost_model(args.cost)
    prefill = offered_load(trace, cost_model, args.arrivals)
    load = max(r.offered_load for r in results)
    peak = max(r.peak_load for r in results)
    if math.isnan(load):
        what = f"arrivals {args.arrivals}: the offered load follows the simulated server"
    elif math.isinf(load):
        what = f"arrivals {args.arrivals}: every request is queued at once"
    else:
        what = (
            f"offered load up to {load:.2f}x, {peak:.2f}x in the busiest tenth of the arrival "
            "span (the load column: prefill and decode without reuse over the span, decoding "
            f"at the batch each row's pool holds; prefill alone {prefill:.2f}x; arrivals "
            f"{args.arrivals})"
        )
        if peak > 1:
            what += (
                ": the simulated server is overloaded, so queues grow and hit rates depend "
                "on scheduling as much as on eviction; --cache-only compares eviction alone"
            )
    print(f"{what}\n")
    print(markdown_table(results, infinite_bound=bound, unit=unit))
    _print_policy_summaries(results, unit)
    if args.out:
        out = _write_results(args, "replay.json", results, trace, bound, unique_tokens=unique)
        write_csv(out / "replay.csv", results)
        plot_hit_rates(out / "hit_rate.png", results, bound, title=Path(args.trace).name)
        log.info(
            "wrote %s",
            ", ".join(str(out / n) for n in ("replay.csv", "replay.json", "hit_rate.png")),
        )
    return 0


def _cluster(args, trace, evictions, sizes, unique) -> int:
    """`replay --replicas N`: every router on N simulated replicas, beside N times the pool in
    one place; with --out, also 1, 2, 4 and 8 replicas as a PNG."""
    from radixserve.sched.routing import make_routing_policy
    from radixserve.sim.cacheonly import simulate_cache
    from radixserve.sim.cluster import cluster_table, plot_replica_sweep, replay_cluster
    from radixserve.sim.replay import ReplayConfig, replay

    if args.cache_only:
        raise InvalidArgumentError("--replicas needs the scheduler: drop --cache-only")
    routers = _split(args.router)
    for router in routers:
        make_routing_policy(router, 1)  # refuse a bad name before anything runs
    cost_model = parse_cost_model(args.cost)
    rows = []
    for eviction in evictions:
        for kind, size in sizes:
            config = ReplayConfig(
                eviction_policy=eviction,
                schedule_policy=_split(args.schedule)[0],
                page_size=args.page_size,
                arrivals=args.arrivals,
                max_running_requests=args.max_running_requests,
                chunked_prefill_size=args.chunked_prefill_size,
                cost_model=cost_model,
                **{"kv_cache_tokens" if kind == "tokens" else "cache_fraction": size},
            )
            results = [
                replay_cluster(trace, config, args.replicas, r, unique=unique) for r in routers
            ]
            big = dataclasses.replace(
                config,
                kv_cache_tokens=results[0].kv_tokens_per_replica * args.replicas,
                cache_fraction=None,
            )
            server = replay(trace, big, unique=unique).token_hit_rate
            pure = simulate_cache(
                trace, eviction, kv_tokens=big.kv_cache_tokens, page_size=args.page_size
            ).hit_rate
            print(f"eviction {eviction}, {results[0].kv_tokens_per_replica} tokens per replica")
            print(cluster_table(results, server, pure) + "\n")
            rows.append(
                {
                    "config": [eviction, kind, size],
                    "one_server_bound": server,
                    "pure_cache_bound": pure,
                    "results": results,
                }
            )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        eviction, (kind, size) = evictions[0], sizes[0]
        first = rows[0]["results"][0]
        config = ReplayConfig(
            eviction_policy=eviction,
            kv_cache_tokens=first.kv_tokens_per_replica,
            page_size=args.page_size,
            arrivals=args.arrivals,
            cost_model=cost_model,
        )
        sweep = [
            replay_cluster(trace, config, n, r, unique=unique)
            for n in (1, 2, 4, 8)
            for r in routers
        ]
        plot_replica_sweep(out / "replicas.png", sweep, title=Path(args.trace).name)
        payload = {
            "replicas": args.replicas,
            "cells": [{**row, "results": [r.as_dict() for r in row["results"]]} for row in rows],
            "replica_sweep": [r.as_dict() for r in sweep],
        }
        (out / "cluster.json").write_text(json.dumps(payload, indent=1))
        log.info("wrote %s and %s", out / "cluster.json", out / "replicas.png")
    return 0


def _load_spec(spec: dict):
    """The trace that a sweep's trace spec (as `cmd_replay` builds it) names."""
    return _load(
        spec["trace"],
        spec["format"],
        spec["block_size"],
        spec["seed"],
        spec["workload_args"],
        spec["keys"] == "blocks",
        spec["skip_bad_lines"],
    )


def _grid(args: argparse.Namespace, spec: dict, evictions, sizes) -> list[dict]:
    """The sweep's cells: every eviction x schedule x size, each naming its trace `spec`."""
    common = {"trace": spec, "page_size": args.page_size}
    common["host_cache"] = args.host_cache or 0
    common["host_eviction"] = args.host_eviction
    common["storage_cache"] = args.storage_cache or 0
    if args.cache_only:
        return [
            {**common, "mode": "cache-only", "eviction": e, "size": [kind, size]}
            for e in evictions
            for kind, size in sizes
        ]
    from radixserve.sim.replay import parse_arrivals

    parse_cost_model(args.cost)  # refuse bad settings before any cell runs
    parse_arrivals(args.arrivals)
    return [
        {
            **common,
            "mode": "replay",
            "eviction": e,
            "schedule": schedule,
            "size": [kind, size],
            "arrivals": args.arrivals,
            "max_running_requests": args.max_running_requests,
            "chunked_prefill_size": args.chunked_prefill_size,
            "cost": args.cost,
        }
        for e in evictions
        for schedule in _split(args.schedule)
        for kind, size in sizes
    ]


_LOADED: dict = {}  # in each sweep process: the trace and its unique-token count


def _sweep_setup(trace: dict, page_size: int, cache_only: bool) -> None:
    from radixserve.sim.oracle import infinite_cache

    _LOADED["trace"] = _load_spec(trace)
    _LOADED["unique"] = infinite_cache(_LOADED["trace"], page_size if cache_only else 1)[1]


def _sweep_cell(cell: dict) -> dict:
    """Run one cell on the process's trace; the result as a dict."""
    from radixserve.sim.cacheonly import simulate_cache
    from radixserve.sim.replay import ReplayConfig, replay

    trace, unique = _LOADED["trace"], _LOADED["unique"]
    kind, size = cell["size"]
    capacity = {
        "tokens": int(size) if kind == "tokens" else None,
        "fraction": size if kind == "fraction" else None,
    }
    progress = sys.stderr.isatty()
    if cell["mode"] == "cache-only":
        result = simulate_cache(
            trace,
            cell["eviction"],
            kv_tokens=capacity["tokens"],
            cache_fraction=capacity["fraction"],
            page_size=cell["page_size"],
            unique=unique,
            progress=progress,
            host_tokens=cell.get("host_cache", 0),
            host_eviction_policy=cell.get("host_eviction", "lru"),
            storage_tokens=cell.get("storage_cache", 0),
        )
        return result.as_dict()
    config = ReplayConfig(
        eviction_policy=cell["eviction"],
        schedule_policy=cell["schedule"],
        kv_cache_tokens=capacity["tokens"],
        cache_fraction=capacity["fraction"],
        page_size=cell["page_size"],
        arrivals=cell["arrivals"],
        max_running_requests=cell["max_running_requests"],
        chunked_prefill_size=cell["chunked_prefill_size"],
        cost_model=parse_cost_model(cell["cost"]),
        host_cache_tokens=cell.get("host_cache", 0),
        host_eviction_policy=cell.get("host_eviction", "lru"),
        storage_cache_tokens=cell.get("storage_cache", 0),
    )
    return replay(trace, config, unique=unique, progress=progress).as_dict()


def _sweep(args: argparse.Namespace, cells: list[dict], trace, unique: int):
    """Run the cells (in `--jobs` processes, journalled under `--out`); the result objects."""
    from radixserve.sim.cacheonly import CacheOnlyResult
    from radixserve.sim.replay import ReplayResult
    from radixserve.sim.sweep import run_grid

    journal = None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        journal = Path(args.out) / "cells.jsonl"
    _LOADED.update(trace=trace, unique=unique)
    dicts = run_grid(
        cells,
        _sweep_cell,
        jobs=args.jobs,
        journal=journal,
        initializer=_sweep_setup if args.jobs > 1 or args.ray else None,
        initargs=(cells[0]["trace"], args.page_size, args.cache_only),
        ray_address=args.ray,
    )
    kind = CacheOnlyResult if args.cache_only else ReplayResult
    return [kind(**d) for d in dicts]


def _cache_only(args, trace, results, bound, unique, unit) -> int:
    from radixserve.sim.report import cache_only_table

    print(
        f"Pure cache simulation of {args.trace}: {len(trace):,} requests in arrival order, "
        f"{unique:,} unique {unit}, no scheduler.\n"
    )
    print(cache_only_table(results, unit, infinite_bound=bound))
    _print_policy_summaries(results, unit)
    if args.out:
        out = _write_results(
            args, "cache_only.json", results, trace, bound, unique=unique, unit=unit
        )
        log.info("wrote %s", out / "cache_only.json")
    return 0


def _print_policy_summaries(results, unit: str) -> None:
    from radixserve.sim.report import policy_summary_lines

    lines = policy_summary_lines(results, unit)
    if lines:
        print("\n" + "\n".join(f"- {line}" for line in lines))


def _write_results(args, name: str, results, trace, bound: float, **extra) -> Path:
    """Write `results` as JSON to `name` under `--out`, with the trace's figures; the folder."""
    from radixserve.sim.report import write_json

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(
        out / name,
        results,
        trace=args.trace,
        requests=len(trace),
        **extra,
        infinite_cache_bound=bound,
    )
    return out


def _study_sizes(value: str) -> list[float]:
    """`radixserve study --cache`: comma-separated percentages, with or without `%`."""
    sizes = []
    for item in _split(value):
        try:
            sizes.append(float(item.removesuffix("%")))
        except ValueError:
            raise InvalidArgumentError(
                f"--cache entries must be percentages like 5 or 5%, got {item!r}"
            ) from None
    return sizes


def cmd_study(args: argparse.Namespace) -> int:
    from radixserve.sim.study import mean_gap_closed, run_study, summarize, write_report

    sizes = _study_sizes(args.cache)
    policies = _split(args.eviction)
    for needed, why in ((args.policy, "--policy"), ("lru", "the summary's baseline")):
        if needed not in policies:
            raise InvalidArgumentError(
                f"--eviction must include {needed!r} ({why}), got {','.join(policies)}"
            )
    workloads = _split(args.workloads) if args.workloads else None
    kwargs = {"workloads": workloads} if workloads else {}

    def progress(row) -> None:
        log.info(
            "%s %s %g%%: %.1f%%", row.workload, row.policy, row.size_percent, 100 * row.hit_rate
        )

    journal = Path(args.out) / "cells.jsonl"
    journal.parent.mkdir(parents=True, exist_ok=True)
    if not args.resume:  # a journal from older code would hand back stale cells
        journal.unlink(missing_ok=True)
    rows = run_study(
        policies=policies,
        sizes=sizes,
        scale=args.scale,
        seed=args.seed,
        jobs=args.jobs,
        progress=progress,
        journal=journal,
        **kwargs,
    )
    md = write_report(args.out, rows, markdown=args.markdown, policy=args.policy, scale=args.scale)
    summaries = summarize(rows, args.policy)
    print(f"wrote {md} and {args.out}/")
    print(f"mean gap closed by {args.policy}: {100 * mean_gap_closed(summaries):.1f}%")
    for s in summaries:
        closed = "n/a" if s.gap_closed is None else f"{100 * s.gap_closed:.0f}%"
        print(
            f"  {s.workload}: gap closed {closed}, worst vs lru {s.worst_vs_lru:+.2f} points, "
            f"worst vs max(lru, lfu) {s.worst_vs_classical:+.2f} points"
        )
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    """Route the serving API over running `radixserve serve` backends until interrupted."""
    import uvicorn

    from radixserve.model.loader import load_tokenizer
    from radixserve.router.app import create_router_app

    events = _split(args.kv_events) if args.kv_events else None
    if args.policy == "precise" and not events:
        raise InvalidArgumentError("--policy precise needs --kv-events, one endpoint per backend")
    app = create_router_app(
        args.backend,
        args.policy,
        load_tokenizer(args.model),
        events,
        page_size=args.page_size,
        events_timeout=args.kv_events_timeout,
    )
    print(
        f"radixserve router on http://{args.host}:{args.port} over {len(args.backend)} "
        f"backends ({args.policy})",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _engine_options(args: argparse.Namespace) -> dict:
    """`EngineConfig` fields from `radixserve serve`'s flags."""
    return {
        "model": args.model,
        "enable_radix_cache": not args.disable_radix_cache,
        "page_size": args.page_size,
        "eviction_policy": args.eviction_policy,
        "schedule_policy": args.schedule_policy,
        "kv_cache_tokens": args.kv_cache_tokens,
        "chunked_prefill_size": args.chunked_prefill_size,
        "enable_mixed_chunk": args.enable_mixed_chunk,
        "enable_jump_forward": args.enable_jump_forward,
        "enable_kv_events": args.kv_events_endpoint is not None,
        "max_running_requests": args.max_running_requests,
        "dtype": args.dtype,
        "weight_format": args.weight_format,
        "device": args.device,
        "threads": args.threads,
        "threads_batch": args.threads_batch,
        "compile": args.compile,
        "compile_aot": args.compile_aot,
        "cuda_graph": not args.disable_cuda_graph,
        "hicache_size_gb": args.hicache_size,
        "hicache_host_dtype": args.hicache_host_dtype,
        "hicache_write_policy": args.hicache_write_policy,
        "hicache_write_through_threshold": args.hicache_write_through_threshold,
        "hicache_eviction_policy": args.hicache_eviction_policy,
        "hicache_storage": args.hicache_storage,
        "hicache_page_size": args.hicache_page_size,
        "hicache_storage_size_gb": args.hicache_storage_size,
        "hicache_prefetch": args.hicache_prefetch,
        "hicache_prefetch_timeout": args.hicache_prefetch_timeout,
    }


def cmd_serve_replicas(args: argparse.Namespace) -> int:
    """`serve --replicas N`: N engines on Ray Serve behind one OpenAI-compatible ingress,
    routed by --router, until SIGINT/SIGTERM."""
    try:
        from radixserve.router.ray_serve import build_app, run_cluster
    except ImportError as exc:
        raise InvalidArgumentError(
            f"--replicas runs on Ray Serve, which is not installed ({exc}); "
            "install it with: pip install 'radixserve[ray]'"
        ) from None
    if args.kv_events_endpoint is not None:
        raise InvalidArgumentError(
            "--kv-events-endpoint is for one server; with --replicas each replica publishes "
            "its KV events on a port of its own node"
        )
    options = _engine_options(args)
    app = build_app(
        options,
        args.replicas,
        args.router,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        request_timeout=args.request_timeout,
        watchdog=args.watchdog or None,
        replica_cpus=args.replica_cpus if args.replica_cpus is not None else args.threads or 1,
    )
    where = args.ray_address or "a local Ray cluster"
    return run_cluster(
        app,
        args.host,
        args.port,
        args.ray_address,
        f"radixserve ready on http://{args.host}:{args.port} ({args.replicas} replicas on "
        f"{where}, router {args.router})",
    )


def check_listenable(host: str, port: int) -> None:
    """Raise unless a server could listen on `host`:`port` now (checked before a model loads
    for seconds, only to find the port taken)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {reason}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until a signal (exit 0 after draining) or an engine failure (exit 1)."""
    if args.replicas is not None:
        return cmd_serve_replicas(args)
    check_listenable(args.host, args.port)
    import asyncio
    import signal

    import uvicorn

    class _GracefulServer(uvicorn.Server):
        """The first Ctrl-C or SIGTERM drains: new requests get 503, running ones get up to
        --shutdown-timeout to finish before they are aborted, then the server exits 0. A second
        signal exits at once."""

        draining = False

        @contextlib.contextmanager
        def capture_signals(self):
            yield

        def request_exit(self, sig: int) -> None:
            if self.draining:
                log.warning("signal %d again: exiting now", sig)
                self.force_exit = self.should_exit = True
                return
            log.info("signal %d: draining for up to %g s", sig, args.shutdown_timeout)
            self.draining = True
            asyncio.get_running_loop().create_task(self.drain_and_exit())

        async def drain_and_exit(self) -> None:
            await app.state.worker.drain(args.shutdown_timeout)
            self.should_exit = True

    from radixserve.engine import Engine
    from radixserve.model.grammar import xgrammar_available
    from radixserve.server.app import create_app

    engine = Engine(**_engine_options(args))
    if xgrammar_available():  # build the grammar compiler now, not on the first request
        threading.Thread(target=engine.grammar_backend, daemon=True).start()
    else:
        log.info("xgrammar is not installed: response_format, tools and grammars are off")
    server: _GracefulServer | None = None

    def on_engine_failure(exc: BaseException) -> None:
        if server is not None:
            server.should_exit = True  # read by uvicorn's main loop; safe from any thread

    app = create_app(
        engine,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        request_timeout=args.request_timeout,
        watchdog=args.watchdog or None,
        on_engine_failure=on_engine_failure,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5
    )
    server = _GracefulServer(config)

    async def serve_and_announce() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_exit, sig)
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(
                f"radixserve ready on http://{args.host}:{args.port} (model {engine.model_name})",
                flush=True,
            )
        await serving

    try:
        asyncio.run(serve_and_announce())
    except SystemExit:
        if server.started:
            raise
        log.critical("radixserve could not start listening on %s:%d", args.host, args.port)
        return 1
    failure = app.state.worker.failure
    if failure is not None:
        log.critical("radixserve stopped: the engine failed (%s)", type(failure).__name__)
        return 1
    log.info("radixserve stopped")
    return 0


def _seconds(text: str, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (value >= 0 if allow_zero else value > 0):
        raise argparse.ArgumentTypeError(f"must be {'>=' if allow_zero else '>'} 0 seconds")
    return value


def _positive_seconds(text: str) -> float:
    return _seconds(text, allow_zero=False)


def _non_negative_seconds(text: str) -> float:
    return _seconds(text, allow_zero=True)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError("a TCP port must be in 1-65535")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser(
        "replay",
        help="replay a trace through the scheduler and cache under a cost model",
        description="Replay TRACE (a Mooncake or radixserve JSONL file, or workload:NAME for a "
        "synthetic workload) for every eviction x schedule x cache size combination.",
    )
    rp.add_argument("trace")
    rp.add_argument("--eviction", default="lru", help="comma-separated policies (or belady)")
    rp.add_argument("--schedule", default="fcfs", help="comma-separated schedule policies")
    rp.add_argument("--cache", default="5%", help="comma-separated sizes: 5%% or token counts")
    rp.add_argument("--page-size", type=int, default=1)
    rp.add_argument(
        "--arrivals",
        default="trace",
        help="trace (its timestamps), burst (all at 0), scaled:X (timestamps / X) or "
        "closed-loop:N (N clients, each sending its next request when the last ends)",
    )
    rp.add_argument("--format", choices=("auto", "mooncake", "tokens"), default="auto")
    rp.add_argument("--block-size", type=int, default=512, help="Mooncake block size")
    rp.add_argument("--max-running-requests", type=int, default=256)
    rp.add_argument("--chunked-prefill-size", type=int, default=8192)
    rp.add_argument("--seed", type=int, default=0, help="seed for workload:NAME traces")
    rp.add_argument(
        "--workload-args", help="generator arguments for workload:NAME, e.g. num_groups=512"
    )
    rp.add_argument(
        "--cost", help="cost-model constants, e.g. decode_step=0.01,prefill_per_token=1e-4"
    )
    rp.add_argument(
        "--cache-only",
        action="store_true",
        help="pure cache simulation in arrival order: no scheduler, queue or cost model",
    )
    rp.add_argument(
        "--host-cache",
        type=_positive_int,
        default=None,
        help="a host tier of this many tokens (keys) behind the --cache pool, written back as "
        "the pool evicts, loaded at host_load_per_token (--cost) in scheduled replays; its "
        "hits are reported apart",
    )
    rp.add_argument(
        "--host-eviction",
        default="lru",
        help="the host tier's eviction policy (any --eviction name but belady)",
    )
    rp.add_argument(
        "--storage-cache",
        type=_positive_int,
        default=None,
        help="a storage tier of this many tokens (keys) behind the pool and host tier, written "
        "through as each request ends (LRU cleanup), loaded at storage_load_per_token (--cost) "
        "in scheduled replays; its hits are reported apart",
    )
    rp.add_argument(
        "--keys",
        choices=("auto", "blocks", "tokens"),
        default="auto",
        help="Mooncake traces: one key per block (auto), or block-size token ids per block; "
        "with blocks, --cache N and the counts are in blocks",
    )
    rp.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="leave out trace lines that fail validation, and report how many",
    )
    rp.add_argument(
        "--jobs", type=int, default=1, help="run the grid's cells in this many processes"
    )
    rp.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run the grid's cells as Ray tasks on the cluster at ADDRESS (`local` starts one "
        "in this process); needs ray",
    )
    rp.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="simulate this many replicas, each with the --cache pool, under each --router",
    )
    rp.add_argument(
        "--router",
        default="round_robin,pow2,cache_aware,precise",
        help="comma-separated routing policies for --replicas",
    )
    rp.add_argument(
        "--out",
        help="directory for replay.csv, replay.json and hit_rate.png, and for cells.jsonl, the "
        "journal of finished cells: run again with the same --out to resume",
    )
    rp.set_defaults(func=cmd_replay)

    st = sub.add_parser(
        "study",
        help="the eviction study: every lab workload x cache size x policy",
        description="Replay every study workload at every cache size under every policy, and "
        "write the markdown report, one PNG per workload and study.json.",
    )
    st.add_argument(
        "--out",
        default="docs/eviction",
        help="directory for PNGs, study.json and cells.jsonl, the journal of finished cells",
    )
    st.add_argument(
        "--resume",
        action="store_true",
        help="read back the cells already in OUT/cells.jsonl instead of simulating them again "
        "(only when the code has not changed since)",
    )
    st.add_argument("--markdown", default=None, help="report file (default: OUT.md)")
    st.add_argument("--eviction", default="lru,lfu,slru,wgd,learned-lru,adaptive,belady")
    st.add_argument("--policy", default="adaptive", help="the policy the summary judges")
    st.add_argument("--cache", default="0.5,1,2,5,10,20", help="sizes, %% of unique tokens")
    st.add_argument("--workloads", default=None, help="comma-separated (default: all)")
    st.add_argument("--scale", type=float, default=1.0, help="multiplies each workload's size")
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--jobs", type=int, default=1, help="replays run in parallel")
    st.set_defaults(func=cmd_study)

    sv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    sv.add_argument(
        "--model",
        default=None,
        help="a .gguf file or HF directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=_port, default=30000)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    sv.add_argument("--served-model-name", default=None)
    sv.add_argument("--max-running-requests", type=int, default=64)
    sv.add_argument("--max-queued-requests", type=int, default=1024)
    sv.add_argument("--disable-radix-cache", action="store_true")
    sv.add_argument("--page-size", type=int, default=1)
    sv.add_argument(
        "--eviction-policy",
        default="adaptive",
        help="which evictable prefixes leave the device pool first (default adaptive; lru for "
        "SGLang's default)",
    )
    sv.add_argument("--schedule-policy", default="fcfs")
    sv.add_argument("--kv-cache-tokens", type=int, default=None)
    sv.add_argument("--chunked-prefill-size", type=int, default=2048)
    sv.add_argument(
        "--enable-mixed-chunk",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode running requests in the same forward as a prefill chunk (default on)",
    )
    sv.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish the radix tree's KV events on this ZMQ PUB address "
        "(e.g. tcp://127.0.0.1:5557; needs the events extra)",
    )
    sv.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="serve missed KV event batches on this ZMQ ROUTER address (e.g. tcp://127.0.0.1:5558)",
    )
    sv.add_argument(
        "--enable-jump-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append text a grammar forces without sampling it token by token (default on)",
    )
    sv.add_argument("--dtype", default=None)
    sv.add_argument(
        "--weight-format",
        default="auto",
        choices=("auto", "float32", "bfloat16", "int8", "int4"),
        help="how linear weights are stored and multiplied (default auto: the file's own "
        "int4/int8 numbers where the CPU runs them faster, else float)",
    )
    sv.add_argument("--device", default="cpu")
    sv.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for the model (for one-token steps when --threads-batch is given)",
    )
    sv.add_argument(
        "--threads-batch",
        type=int,
        default=None,
        help="CPU threads for steps of more than one token (default: --threads), as "
        "llama.cpp's -tb; one-token steps use --threads, so --threads below the core count "
        "leaves a core to the server and its clients while a lone stream decodes",
    )
    sv.add_argument(
        "--compile",
        action="store_true",
        help="run decode steps through torch.compile (faster small-batch decode; the first "
        "start compiles for a minute or more, later starts reuse the on-disk cache)",
    )
    sv.add_argument(
        "--compile-aot",
        action="store_true",
        help="as --compile, with the batch-1 step compiled ahead of time by AOTInductor "
        "(faster single-stream decode on CPU; the first start compiles for a few minutes, "
        "later starts load the package from ~/.cache/radixserve/aot or $RADIXSERVE_CACHE)",
    )
    sv.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="on CUDA, launch decode steps kernel by kernel instead of replaying captured "
        "CUDA graphs (slower for small batches; for debugging)",
    )
    sv.add_argument(
        "--request-timeout",
        type=_positive_seconds,
        default=None,
        help="abort a request still running this many seconds after it arrived (default: off)",
    )
    sv.add_argument(
        "--shutdown-timeout",
        type=_non_negative_seconds,
        default=10.0,
        help="on SIGTERM, seconds running requests get to finish before they are aborted",
    )
    sv.add_argument(
        "--watchdog",
        type=_non_negative_seconds,
        default=60.0,
        help="/health turns 503 when the engine makes no progress for this long (0: off)",
    )
    sv.add_argument(
        "--hicache-size",
        type=float,
        default=None,
        help="GB of host memory for a second KV tier: prefixes evicted from the device pool "
        "are loaded back from it instead of recomputed",
    )
    sv.add_argument(
        "--hicache-host-dtype",
        default=None,
        choices=("float32", "bfloat16", "float16", "float64"),
        help="keep host-tier pages in this dtype (e.g. bfloat16: twice the tokens per GB of a "
        "float32 pool, rounded; default: the KV pool's own, exact)",
    )
    sv.add_argument(
        "--hicache-write-policy",
        default="write_through",
        choices=("write_through", "write_through_selective", "write_back"),
        help="when the host tier gets a prefix: as each request ends (default), once it was "
        "offered --hicache-write-through-threshold times, or when the device evicts it",
    )
    sv.add_argument("--hicache-write-through-threshold", type=_positive_int, default=2)
    sv.add_argument(
        "--hicache-eviction-policy",
        default="lru",
        help="which host-tier pages leave first when it is full: any --eviction-policy name "
        "(a chain's last pages always go before its first)",
    )
    sv.add_argument(
        "--hicache-storage",
        default=None,
        help="keep KV pages in persistent storage too, and load prompts' prefixes back from "
        "it: file:DIR (survives restarts) or redis://HOST:PORT (shared; the redis extra)",
    )
    sv.add_argument(
        "--hicache-page-size",
        type=_positive_int,
        default=64,
        help="tokens per storage page (a multiple of --page-size; default 64)",
    )
    sv.add_argument(
        "--hicache-storage-size",
        type=float,
        default=None,
        help="GB a file: store may take; the least recently used pages go first",
    )
    sv.add_argument(
        "--hicache-prefetch",
        default="timeout",
        choices=("best_effort", "wait_complete", "timeout"),
        help="how long a request waits in the queue for its prefix to load: not at all, until "
        "it has loaded, or up to --hicache-prefetch-timeout (default)",
    )
    sv.add_argument("--hicache-prefetch-timeout", type=_non_negative_seconds, default=2.0)
    sv.add_argument(
        "--replicas",
        type=_positive_int,
        default=None,
        help="run this many engine replicas on Ray Serve behind one ingress (needs the ray "
        "extra); without --ray-address, on an in-process local Ray cluster",
    )
    sv.add_argument(
        "--router",
        default="precise",
        choices=("round_robin", "pow2", "cache_aware", "precise"),
        help="with --replicas: the routing policy (default precise: by the replicas' KV events)",
    )
    sv.add_argument(
        "--ray-address",
        default=None,
        help="with --replicas: join this Ray cluster (auto, or HOST:PORT of its head) instead "
        "of starting one",
    )
    sv.add_argument(
        "--replica-cpus",
        type=float,
        default=None,
        help="with --replicas: CPUs Ray reserves per replica (default --threads, else 1)",
    )
    sv.set_defaults(func=cmd_serve)

    ro = sub.add_parser(
        "router",
        help="route the serving API over several `radixserve serve` backends",
        description="Pick a backend per request with a routing policy (radixserve.sched."
        "routing); `precise` follows each backend's --kv-events-endpoint.",
    )
    ro.add_argument("--backend", action="append", required=True, help="a backend's base URL")
    ro.add_argument(
        "--policy",
        default="cache_aware",
        choices=("round_robin", "pow2", "cache_aware", "precise"),
    )
    ro.add_argument("--kv-events", help="comma-separated ZMQ endpoints, one per --backend")
    ro.add_argument(
        "--kv-events-timeout",
        type=_positive_seconds,
        default=10.0,
        help="forget a backend's pages when no KV event batch (backends send a heartbeat "
        "every second) has come for this long (default 10 s)",
    )
    ro.add_argument("--model", default=None, help="the served model (for its tokenizer)")
    ro.add_argument("--page-size", type=int, default=1, help="the backends' page size")
    ro.add_argument("--host", default="127.0.0.1")
    ro.add_argument("--port", type=_port, default=30100)
    ro.set_defaults(func=cmd_router)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except (InvalidArgumentError, FileNotFoundError) as exc:
        parser.exit(2, f"radixserve: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
