"""Two replicas behind the router: does routing by KV content beat round robin, for real?

Two `radixserve serve` processes on the embedded model (1 thread each, a small KV pool each,
publishing KV events) sit behind `radixserve router`. A shared-prefix workload (groups of
requests sharing a long system prompt) is sent over HTTP with Poisson arrivals, once through a
`round_robin` router and once through a `precise` one, against the same backends (their
caches flushed in between), in the same run. Reported per policy: requests/s, output
tokens/s, TTFT p50 and p99, and the backends' hit rate from `/metrics`; then precise /
round_robin. The issue's target: >= 1.3x the throughput, with a lower p50 TTFT.

    python bench/cluster.py
    python bench/cluster.py --groups 16 --per-group 4 --rate 1.5
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import httpx

from serve import free_port, read_counters, run_rate, start_server, workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--system", type=int, default=768, help="shared prefix tokens")
    parser.add_argument("--question", type=int, default=32)
    parser.add_argument("--output", type=int, default=16)
    parser.add_argument("--kv-cache-tokens", type=int, default=6144, help="per backend")
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second offered")
    parser.add_argument("--policies", default="round_robin,precise")
    args = parser.parse_args()
    prompts = workload(args.groups, args.per_group, args.system, args.question, seed=0)
    print(
        f"workload: {len(prompts)} requests in {args.groups} groups sharing {args.system}-token "
        f"prefixes, {args.question}-token questions, {args.output} output tokens; "
        f"{args.kv_cache_tokens} KV tokens per backend; {args.rate} req/s offered"
    )
    backends, urls, events = [], [], []
    try:
        for _ in range(2):
            port, ep = free_port(), f"tcp://127.0.0.1:{free_port()}"
            command = [
                sys.executable, "-m", "radixserve.cli", "serve", "--threads", "1",
                "--kv-cache-tokens", str(args.kv_cache_tokens), "--port", str(port),
                "--kv-events-endpoint", ep,
            ]  # fmt: skip
            backends.append(start_server(command, port, "ready"))
            urls.append(f"http://127.0.0.1:{port}")
            events.append(ep)
        rows = {}
        for policy in args.policies.split(","):
            for url in urls:
                httpx.post(f"{url}/flush_cache", timeout=30)
            before = [read_counters(url) for url in urls]
            port = free_port()
            command = [
                sys.executable, "-m", "radixserve.cli", "router", "--policy", policy,
                "--port", str(port), "--kv-events", ",".join(events),
                *[arg for url in urls for arg in ("--backend", url)],
            ]  # fmt: skip
            router = start_server(command, port, "router on")
            try:
                row = asyncio.run(
                    run_rate(f"http://127.0.0.1:{port}", prompts, args.rate, args.output, seed=1)
                )
            finally:
                router.terminate()
                router.wait(30)
            after = [read_counters(url) for url in urls]
            prompt = sum(
                a["radixserve_prompt_tokens_total"] - b.get("radixserve_prompt_tokens_total", 0)
                for a, b in zip(after, before, strict=True)
            )
            cached = sum(
                a["radixserve_cached_prompt_tokens_total"]
                - b.get("radixserve_cached_prompt_tokens_total", 0)
                for a, b in zip(after, before, strict=True)
            )
            row["hit"] = cached / prompt if prompt else float("nan")
            rows[policy] = row
            print(
                f"  {policy:<12} {row['req_s']:5.2f} req/s {row['tok_s']:6.1f} tok/s  "
                f"TTFT p50 {row['ttft50']:5.2f} p99 {row['ttft99']:5.2f} s  "
                f"hit {100 * row['hit']:5.1f}%",
                flush=True,
            )
        if "round_robin" in rows and "precise" in rows:
            rr, pr = rows["round_robin"], rows["precise"]
            print(
                f"precise / round_robin: throughput {pr['tok_s'] / rr['tok_s']:.2f}x, "
                f"TTFT p50 {pr['ttft50'] / rr['ttft50']:.2f}x, hit rate "
                f"{100 * pr['hit']:.1f}% against {100 * rr['hit']:.1f}%"
            )
    finally:
        for proc in backends:
            proc.terminate()
        for proc in backends:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
