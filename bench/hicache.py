"""KV storage: is a prefix read back from storage faster than computing it again, for real?

1. Restart, `file:` storage. `radixserve serve --hicache-storage file:DIR` on the embedded
   model answers questions on `--prefixes` different 2,000-token prefixes (cold: computed);
   it is stopped and started again, and answers new questions on the same prefixes (warm:
   loaded from storage). TTFT is the client's time for a one-token answer. The baseline is the
   cold TTFT of the same run; the issue's target is warm <= 0.3x cold.
2. Two engines sharing `redis://` (skipped without `redis-server`): engine A answers on new
   prefixes; engine B's first request on each prefix must be a storage hit. Reported: B's
   TTFT against A's (cold) and the tokens B loaded.
3. Multi-turn chat, device pool only against the same pool plus a host tier (`--hicache-size`).
   `--sessions` conversations, each a `--context`-token document then turns of a 64-token
   question and a 32-token answer, take turns, four requests in flight, so that their working
   set is several times the device pool and fits the host tier. Reported for each: hit rate,
   output tokens/s, TTFT p50/p99; the target is host-tier TTFT p50 <= 0.5x device-only.

    python bench/hicache.py
    python bench/hicache.py --prefix 4000 --prefixes 5
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from serve import free_port, one_request, start_server


def serve(storage: str | None, args, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port),
        "--kv-cache-tokens", str(args.kv_cache_tokens), *flags,
    ]  # fmt: skip
    if storage is not None:
        command += ["--hicache-storage", storage, "--hicache-prefetch", "wait_complete"]
    if args.threads:
        command += ["--threads", str(args.threads)]
    return start_server(command, port, "ready"), f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(120)  # pending storage writes finish first


def ask(url: str, ids: list[int]) -> tuple[float, dict]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    start = time.perf_counter()
    reply = httpx.post(f"{url}/generate", json=body, timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - start, reply.json()["meta_info"]


def question(rng) -> list[int]:
    return rng.integers(100, 40_000, 16).tolist()


def restart(args, rng) -> None:
    prefixes = [rng.integers(100, 40_000, args.prefix).tolist() for _ in range(args.prefixes)]
    root = Path(tempfile.mkdtemp(prefix="radixserve-hicache-"))
    try:
        proc, url = serve(f"file:{root}", args)
        try:
            ask(url, question(rng))  # warm the process up (first forward, allocator)
            cold = [ask(url, p + question(rng))[0] for p in prefixes]
        finally:
            stop(proc)
        stored = sum(f.stat().st_size for f in root.rglob("*.kv"))
        proc, url = serve(f"file:{root}", args)
        try:
            ask(url, question(rng))
            answers = [ask(url, p + question(rng)) for p in prefixes]
        finally:
            stop(proc)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    warm = statistics.median(seconds for seconds, _ in answers)
    cold_p50 = statistics.median(cold)
    loaded = [meta["storage_cached_tokens"] for _, meta in answers]
    print(
        f"restart, file storage ({stored / 2**20:.0f} MiB written): {args.prefixes} prefixes "
        f"of {args.prefix} tokens; cold TTFT p50 {cold_p50:.3f} s, warm after restart "
        f"{warm:.3f} s -> {warm / cold_p50:.2f}x cold (target <= 0.3x); loaded "
        f"{min(loaded)}-{max(loaded)} tokens per request",
        flush=True,
    )


def shared_redis(args, rng) -> None:
    server = shutil.which("redis-server")
    if server is None:
        print("redis: skipped (redis-server is not installed)")
        return
    port = free_port()
    redis = subprocess.Popen(
        [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)
        uri = f"redis://127.0.0.1:{port}/0"
        a, url_a = serve(uri, args)
        b, url_b = serve(uri, args)
        try:
            prefixes = [rng.integers(100, 40_000, args.prefix).tolist() for _ in range(3)]
            for url in (url_a, url_b):
                ask(url, question(rng))
            cold = [ask(url_a, p + question(rng))[0] for p in prefixes]
            time.sleep(1.0)  # A's writes land
            answers = [ask(url_b, p + question(rng)) for p in prefixes]
        finally:
            stop(a)
            stop(b)
    finally:
        redis.terminate()
        redis.wait(10)
    hit = [seconds for seconds, _ in answers]
    loaded = [meta["storage_cached_tokens"] for _, meta in answers]
    print(
        f"two engines sharing redis: engine A cold TTFT p50 {statistics.median(cold):.3f} s; "
        f"engine B's first request on A's prefix {statistics.median(hit):.3f} s -> "
        f"{statistics.median(hit) / statistics.median(cold):.2f}x, loaded {loaded} tokens"
    )


def multi_turn(args, rng) -> None:
    sessions = [rng.integers(100, 40_000, args.context).tolist() for _ in range(args.sessions)]
    requests = []
    for _ in range(args.turns):
        for history in sessions:
            history += rng.integers(100, 40_000, 64).tolist()  # the user's question
            requests.append(list(history))
            history += rng.integers(100, 40_000, 32).tolist()  # the answer, as sent back
    per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M's fp32 KV bytes per token
    host_gb = args.host_tokens * per_token / 2**30
    rows = {}
    for name, flags in (
        ("device only", ()),
        (f"+ host {args.host_tokens} tokens", ("--hicache-size", f"{host_gb:.3f}")),
    ):
        device = argparse.Namespace(**{**vars(args), "kv_cache_tokens": args.device_tokens})
        proc, url = serve(None, device, *flags)
        try:
            rows[name] = asyncio.run(_replay_chat(url, requests))
        finally:
            stop(proc)
        r = rows[name]
        print(
            f"multi-turn, {args.sessions} sessions x {args.turns} turns, device pool "
            f"{args.device_tokens} tokens, {name}: hit {100 * r['hit']:.1f}%, "
            f"{r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft50']:.2f} s p99 {r['ttft99']:.2f} s",
            flush=True,
        )
    base, host = rows.values()
    print(
        f"host tier / device only: TTFT p50 {host['ttft50'] / base['ttft50']:.2f}x (target "
        f"<= 0.5x), throughput {host['tok_s'] / base['tok_s']:.2f}x"
    )


async def _replay_chat(url: str, requests: list[list[int]], in_flight: int = 4) -> dict:
    """Send `requests` in order, at most `in_flight` at once; TTFT, throughput, hit rate."""
    limit = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient(timeout=900) as client:

        async def one(prompt):
            async with limit:
                return await one_request(client, url, prompt, 32)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in requests))
        wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    return {
        "hit": sum(r["cached"] for r in results) / max(1, sum(r["prompt"] for r in results)),
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft50": float(np.percentile(ttft, 50)),
        "ttft99": float(np.percentile(ttft, 99)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prefix", type=int, default=2000, help="prefix tokens")
    parser.add_argument("--prefixes", type=int, default=3)
    parser.add_argument("--kv-cache-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--context", type=int, default=1000, help="tokens each session opens with")
    parser.add_argument("--device-tokens", type=int, default=8192)
    parser.add_argument("--host-tokens", type=int, default=65536)
    parser.add_argument("--parts", default="restart,redis,multi-turn")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    parts = args.parts.split(",")
    if "restart" in parts:
        restart(args, rng)
    if "redis" in parts:
        shared_redis(args, rng)
    if "multi-turn" in parts:
        multi_turn(args, rng)


if __name__ == "__main__":
    main()
