"""KV storage: is a prefix read back from storage faster than computing it again, for real?

1. Restart, `file:` storage. `radixserve serve --hicache-storage file:DIR` on the embedded
   model answers questions on `--prefixes` different 2,000-token prefixes (cold: computed);
   it is stopped and started again, and answers new questions on the same prefixes (warm:
   loaded from storage). TTFT is the client's time for a one-token answer. The baseline is the
   cold TTFT of the same run; the issue's target is warm <= 0.3x cold.
2. Two engines sharing `redis://` (skipped without `redis-server`): engine A answers on new
   prefixes; engine B's first request on each prefix must be a storage hit. Reported: B's
   TTFT against A's (cold) and the tokens B loaded.

    python bench/hicache.py
    python bench/hicache.py --prefix 4000 --prefixes 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from serve import free_port, start_server


def serve(storage: str, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port),
        "--hicache-storage", storage, "--kv-cache-tokens", str(args.kv_cache_tokens),
        "--hicache-prefetch", "wait_complete",
    ]  # fmt: skip
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prefix", type=int, default=2000, help="prefix tokens")
    parser.add_argument("--prefixes", type=int, default=3)
    parser.add_argument("--kv-cache-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-redis", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    restart(args, rng)
    if not args.skip_redis:
        shared_redis(args, rng)


if __name__ == "__main__":
    main()
