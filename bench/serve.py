"""Serving under load: radixserve with the radix cache on, against the same server with it off.

An asynchronous httpx load generator replays a shared-prefix workload (groups of requests
sharing a system prompt, each with its own question) with Poisson arrivals at several rates,
streaming every answer. For each server and rate it reports request throughput, output
tokens/s, TTFT and TPOT at p50 and p99, and the cache hit rate read from `/metrics`. With
`--llama-cpp` it also runs llama-cpp-python's OpenAI server on the same GGUF (installing it
first with `--install-llama-cpp`). With `--llama-server` it builds llama.cpp's own
`llama-server` with cmake from the llama.cpp sources vendored in the llama-cpp-python sdist
(LLAMA_CPP_VERSION, downloaded from PyPI; cached under ~/.cache/radixserve-bench) and runs it
with 8 parallel slots and continuous batching (`-np 8 -cb`) on the same GGUF and the same
token ids; both sides count tokens the same way (`ignore_eos`, equal `max_tokens`).
`--compile` starts the radixserve servers with `--compile`, `--compile-aot` with `--compile-aot`.
Every rate starts cold on every server (radixserve flushes its cache, llama.cpp's servers are
restarted); `--warm` instead precedes each rate by an unmeasured pass of the same system
prompts with other questions, so that every server holds the shared prefixes (llama-server in
its slots) and none of the measured questions.

    python bench/serve.py                     # rates 0.5, 1, 2 req/s, 32 requests each
    python bench/serve.py --quick             # one rate, 12 requests
    python bench/serve.py --long-prompt       # mixed chunks on and off, a long prompt arriving
    python bench/serve.py --servers on --llama-server --compile   # against llama-server -np 8

`--repeats N` runs the servers N times in turn (radixserve, then the peers, then radixserve
again), so that a shared machine's slow spells fall on both sides; it prints each repeat's
ratio and their median.

`--rates inf` sends every request at once: the servers' throughput at saturation. At a finite
rate no server can beat the arrivals (each row prints the bound: output tokens over the span
of the arrivals); at 8 req/s the 32 requests' arrivals span 4.6 s, so the bound is about
110 tok/s and a faster server gains only latency there.

`--long-prompt` streams 8 answers of 120 tokens and sends a 2,048-token prompt one second in,
against a server with mixed chunks on and one with them off, and reports the streams' time
between tokens (p50, p99, max): how long a running stream stalls while a long prompt is
prefilled.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import numpy as np

from engine import LLAMA_CPP_CMAKE_ARGS, LLAMA_CPP_VERSION
from radixserve.model.loader import default_model_path

LLAMA_SERVER_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    # No web UI: its assets are not in the sdist and would be fetched from a model hub.
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    *LLAMA_CPP_CMAKE_ARGS.split(),  # the GGML flags bench/engine.py builds llama.cpp with
]


def build_llama_server(cache: Path) -> Path:
    """llama.cpp's `llama-server`, built once from the sources vendored in llama-cpp-python's
    sdist (downloaded from PyPI) with cmake; returns the binary."""
    source = cache / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"
    build = cache / "llama-server-build"
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    if not source.exists():
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run(
            [*pip, f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(cache)], check=True
        )
        with tarfile.open(cache / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz") as sdist:
            sdist.extractall(cache, filter="data")
    cmake = shutil.which("cmake")
    if cmake is None:  # the PyPI cmake package puts one beside this interpreter
        subprocess.run([sys.executable, "-m", "pip", "install", "cmake"], check=True)
        cmake = str(Path(sys.executable).parent / "cmake")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    print(f"  building llama-server from {source} (several minutes)", flush=True)
    subprocess.run(
        [cmake, "-S", str(source), "-B", str(build), *generator, *LLAMA_SERVER_CMAKE_FLAGS],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        [cmake, "--build", str(build), "--target", "llama-server", "-j", jobs],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return binary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(command: list[str], port: int, ready: str | None) -> subprocess.Popen:
    # Without a ready line to wait for, nobody reads the output: discard it, or a chatty
    # server blocks on a full pipe.
    output = subprocess.PIPE if ready is not None else subprocess.DEVNULL
    proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True)
    # A first start with --compile-aot compiles for minutes before it serves.
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if ready is not None:
            line = proc.stdout.readline()
            if ready in line:
                return proc
            if not line and proc.poll() is not None:
                break
        else:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                    return proc
            except httpx.HTTPError:
                time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not start: {' '.join(command)}")


def workload(groups: int, per_group: int, system: int, question: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(groups):
        head = rng.integers(100, 40_000, system).tolist()
        prompts += [head + rng.integers(100, 40_000, question).tolist() for _ in range(per_group)]
    order = rng.permutation(len(prompts))
    return [prompts[i] for i in order]


def new_questions(prompts: list, question: int, seed: int) -> list:
    """The same prompts with their last `question` tokens drawn afresh: the same shared
    prefixes, none of the same questions."""
    rng = np.random.default_rng(seed)
    return [p[:-question] + rng.integers(100, 40_000, question).tolist() for p in prompts]


def read_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for name in ("radixserve_prompt_tokens_total", "radixserve_cached_prompt_tokens_total"):
        match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
        if match:
            out[name] = float(match.group(1))
    return out


async def one_request(client: httpx.AsyncClient, url: str, prompt, max_tokens: int) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    first = None
    tokens = chunks = 0
    usage: dict = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            item = json.loads(line[6:])
            if item.get("choices") and item["choices"][0].get("text"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
            if item.get("usage"):
                usage = item["usage"]
                tokens = usage["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    tokens = tokens or chunks  # a server that sends no usage streams one token per chunk
    return {
        "ttft": first - start,
        "e2e": end - start,
        "tokens": tokens,
        "tpot": (end - first) / max(1, tokens - 1),
        "prompt": usage.get("prompt_tokens", 0),
        "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


async def run_rate(url: str, prompts, rate: float, max_tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(prompts))
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one_request(client, url, prompt, max_tokens)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    pct = lambda key, q: float(np.percentile([r[key] for r in results], q))  # noqa: E731
    tokens = sum(r["tokens"] for r in results)
    span = float(gaps.sum())
    return {
        "req_s": len(results) / wall,
        "tok_s": tokens / wall,
        # No server can finish before the last arrival: tokens over the arrivals' span bounds
        # tok_s (infinite at --rates inf, where every request is sent at once).
        "arrival_bound": tokens / span if span > 0 else float("inf"),
        "ttft50": pct("ttft", 50),
        "ttft99": pct("ttft", 99),
        "tpot50": pct("tpot", 50),
        "tpot99": pct("tpot", 99),
        "usage_hit": sum(r["cached"] for r in results) / max(1, sum(r["prompt"] for r in results)),
    }


def bench_server(
    name, command, port, ready, prompts, rates, max_tokens, warm_prompts=None
) -> list[dict]:
    """One row per rate. Every rate starts cold on every server: radixserve flushes its cache,
    a server without that endpoint is restarted. With `warm_prompts` (the same shared prefixes
    with other questions), an unmeasured pass of them then precedes the rate, so that every
    server starts it holding what the workload shares and none of its questions."""
    proc = start_server(command, port, ready)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        for k, rate in enumerate(rates):
            if k and ready:
                httpx.post(f"{url}/flush_cache", timeout=30)
            elif k:
                proc.terminate()
                proc.wait(30)
                proc = start_server(command, port, ready)
            if warm_prompts is not None:
                asyncio.run(run_rate(url, warm_prompts, max(rates), max_tokens, seed=100 + k))
            before = read_counters(url) if ready else {}
            row = asyncio.run(run_rate(url, prompts, rate, max_tokens, seed=k))
            if ready:
                after = read_counters(url)
                prompt = after["radixserve_prompt_tokens_total"] - before.get(
                    "radixserve_prompt_tokens_total", 0
                )
                cached = after["radixserve_cached_prompt_tokens_total"] - before.get(
                    "radixserve_cached_prompt_tokens_total", 0
                )
                row["hit"] = cached / prompt if prompt else float("nan")
            rows.append({"server": name, "rate": rate, **row})
            print_row(rows[-1])
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


async def long_prompt_arrival(url: str, streams: int = 8, prompt_tokens: int = 2048) -> dict:
    """Gaps between the tokens of `streams` running answers while a long prompt arrives."""
    rng = np.random.default_rng(7)

    async def stream(client, prompt) -> list[float]:
        body = {"prompt": prompt, "max_tokens": 120, "stream": True, "ignore_eos": True}
        times = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"text": ""' not in line:
                    times.append(time.perf_counter())
        return list(np.diff(times))

    async with httpx.AsyncClient(timeout=600) as client:
        prompts = [rng.integers(100, 40_000, 32).tolist() for _ in range(streams)]
        tasks = [asyncio.create_task(stream(client, p)) for p in prompts]
        await asyncio.sleep(1.0)
        long = {"prompt": rng.integers(100, 40_000, prompt_tokens).tolist(), "max_tokens": 1}
        await client.post(f"{url}/v1/completions", json=long)
        gaps = np.concatenate([await t for t in tasks]) * 1e3
    return {f"p{q}": float(np.percentile(gaps, q)) for q in (50, 99)} | {"max": float(gaps.max())}


def bench_long_prompt(base: list[str]) -> None:
    print(f"long prompt: 8 streams of 120 tokens, a 2,048-token prompt arrives 1 s in; {base[3:]}")
    for name, extra in (("mixed on", []), ("mixed off", ["--no-enable-mixed-chunk"])):
        port = free_port()
        proc = start_server([*base, *extra, "--port", str(port)], port, "ready")
        try:
            row = asyncio.run(long_prompt_arrival(f"http://127.0.0.1:{port}"))
        finally:
            proc.terminate()
            proc.wait(30)
        print(
            f"  {name:<10} time between a stream's tokens: p50 {row['p50']:6.0f} ms, "
            f"p99 {row['p99']:6.0f} ms, max {row['max']:6.0f} ms",
            flush=True,
        )


def print_row(r: dict) -> None:
    hit = f"{100 * r['hit']:6.1f}%" if "hit" in r else "    n/a"
    print(
        f"  {r['server']:<22} {r['rate']:>5.2f} req/s offered: {r['req_s']:6.2f} req/s "
        f"{r['tok_s']:7.1f} tok/s  TTFT p50 {r['ttft50']:6.2f} p99 {r['ttft99']:6.2f} s  "
        f"TPOT p50 {1e3 * r['tpot50']:6.1f} p99 {1e3 * r['tpot99']:6.1f} ms  hit {hit}  "
        f"(arrivals allow at most {r['arrival_bound']:.0f} tok/s)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rates", default="0.5,1,2")
    parser.add_argument(
        "--threads", type=int, default=2, help="one-token-step threads, every server"
    )
    parser.add_argument(
        "--threads-batch",
        type=int,
        default=None,
        help="threads for larger steps (default --threads)",
    )
    parser.add_argument(
        "--servers", default="on,off", help="radixserve configurations to run: on, off (cache)"
    )
    parser.add_argument("--llama-cpp", action="store_true", help="also bench llama-cpp-python")
    parser.add_argument(
        "--install-llama-cpp",
        action="store_true",
        help="pip install llama-cpp-python[server] first (builds llama.cpp)",
    )
    parser.add_argument(
        "--llama-server", action="store_true", help="also bench llama.cpp's llama-server -np 8"
    )
    parser.add_argument("--compile", action="store_true", help="radixserve serve --compile")
    parser.add_argument("--compile-aot", action="store_true", help="radixserve serve --compile-aot")
    parser.add_argument("--long-prompt", action="store_true", help="only the mixed-chunk run")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="every server starts each rate holding the workload's prefixes (default: cold)",
    )
    parser.add_argument("--chunked-prefill-size", type=int, default=None, help="for the servers")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every server this many times, alternating, and report the median ratio",
    )
    args = parser.parse_args()
    groups, per_group, system, question, out = (
        (3, 4, 256, 32, 16) if args.quick else (4, 8, 512, 32, 16)
    )
    rates = [1.0] if args.quick else [float(r) for r in args.rates.split(",")]
    threads_batch = args.threads_batch or args.threads
    prompts = workload(groups, per_group, system, question, seed=0)
    warm_prompts = new_questions(prompts, question, seed=1) if args.warm else None
    unique = groups * system + len(prompts) * question
    total = sum(len(p) for p in prompts)
    print(
        f"workload: {len(prompts)} requests, {groups} groups, {system}-token system prompts, "
        f"{question}-token questions, {out} output tokens; prompt tokens {total}, unique "
        f"{unique} (ideal hit rate {1 - unique / total:.1%})"
    )
    base = [
        sys.executable,
        "-m",
        "radixserve.cli",
        "serve",
        "--threads",
        str(args.threads),
        "--threads-batch",
        str(threads_batch),
        "--kv-cache-tokens",
        "32768",
    ]
    if args.chunked_prefill_size is not None:
        base += ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    if args.compile:
        base.append("--compile")
    if args.compile_aot:
        base.append("--compile-aot")
    if args.long_prompt:
        bench_long_prompt(base)
        return
    if args.install_llama_cpp:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "llama-cpp-python[server]"], check=True
        )
    # (name, command for a port, ready line, prompts, warm prompts) of every server to run.
    servers = []
    wanted = set(args.servers.split(","))
    for key, name, extra in (
        ("on", "radixserve, cache on", []),
        ("off", "radixserve, cache off", ["--disable-radix-cache"]),
    ):
        if key in wanted:
            command = lambda port, extra=extra: [*base, *extra, "--port", str(port)]  # noqa: E731
            servers.append((name, command, "ready", prompts, warm_prompts))
    if args.llama_cpp or args.install_llama_cpp:
        if importlib.util.find_spec("llama_cpp") is None:
            print("  llama-cpp-python is not installed; pass --install-llama-cpp")
        else:
            # llama-cpp-python's server takes text prompts only: send the same prompts as text.
            from gguf import GGUFReader

            from radixserve.model.loader import gguf_tokenizer

            tokenizer = gguf_tokenizer(GGUFReader(str(default_model_path())))
            text_prompts = [tokenizer.decode(p) for p in prompts]
            text_warm = warm_prompts and [tokenizer.decode(p) for p in warm_prompts]

            def llama_cpp_command(port: int) -> list[str]:
                return [
                    sys.executable,
                    "-m",
                    "llama_cpp.server",
                    "--model",
                    str(default_model_path()),
                    "--port",
                    str(port),
                    "--n_threads",
                    str(args.threads),
                    "--n_threads_batch",
                    str(threads_batch),
                    "--n_ctx",
                    "4096",
                ]

            servers.append(("llama-cpp-python", llama_cpp_command, None, text_prompts, text_warm))
    if args.llama_server:
        binary = build_llama_server(Path.home() / ".cache" / "radixserve-bench")
        slots, per_slot = 8, 2048

        def llama_server_command(port: int) -> list[str]:
            return [
                str(binary),
                "--model",
                str(default_model_path()),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--threads",
                str(args.threads),
                "--threads-batch",
                str(threads_batch),
                "-np",
                str(slots),
                "-cb",
                "--ctx-size",
                str(slots * per_slot),
            ]

        servers.append(("llama-server -np 8", llama_server_command, None, prompts, warm_prompts))
    results = []
    for repeat in range(args.repeats):
        if args.repeats > 1:
            print(f"repeat {repeat + 1} of {args.repeats}")
        for name, command, ready, server_prompts, server_warm in servers:
            port = free_port()
            results += bench_server(
                name, command(port), port, ready, server_prompts, rates, out, server_warm
            )

    on = [r for r in results if r["server"] == "radixserve, cache on"]
    for other in ("radixserve, cache off", "llama-server -np 8"):
        rows = [r for r in results if r["server"] == other]
        ratios: dict[float, list[float]] = {}
        for a, b in zip(on, rows, strict=True) if on and rows else ():
            ratios.setdefault(a["rate"], []).append(a["tok_s"] / b["tok_s"])
            print(
                f"  rate {a['rate']}: cache on against {other}: throughput "
                f"{a['tok_s'] / b['tok_s']:.2f}x, TTFT p50 {a['ttft50'] / b['ttft50']:.2f}x"
            )
        for rate, values in ratios.items() if args.repeats > 1 else ():
            print(
                f"  rate {rate}: cache on against {other}, {len(values)} alternating repeats: "
                f"throughput median {np.median(values):.2f}x "
                f"(min {min(values):.2f}x, max {max(values):.2f}x)"
            )


if __name__ == "__main__":
    main()
