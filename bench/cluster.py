"""Two replicas behind the router: does routing by KV content beat round robin, for real?

Two modes, both on this machine, both over HTTP with the same workload:
- default: two `radixserve serve` processes behind `radixserve router` (below);
- `--ray`: `radixserve serve --replicas 2` on an in-process Ray cluster, the policy running as
  Serve's request router, with Ray's own `PrefixCacheAffinityRouter` (importable without
  vLLM) beside ours as the peer. Hit rates come from the answers' usage.

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
    parser.add_argument(
        "--ray",
        action="store_true",
        help="replicas on Ray Serve; --policies may add ray_prefix "
        "(Ray's PrefixCacheAffinityRouter)",
    )
    args = parser.parse_args()
    prompts = workload(args.groups, args.per_group, args.system, args.question, seed=0)
    print(
        f"workload: {len(prompts)} requests in {args.groups} groups sharing {args.system}-token "
        f"prefixes, {args.question}-token questions, {args.output} output tokens; "
        f"{args.kv_cache_tokens} KV tokens per backend; {args.rate} req/s offered"
    )
    if args.ray:
        report(bench_ray(args, prompts))
        return
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
            print_row(policy, row)
        report(rows)
    finally:
        for proc in backends:
            proc.terminate()
        for proc in backends:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


RAY_PEER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router."
    "PrefixCacheAffinityRouter"
)


def bench_ray(args, prompts) -> dict:
    """Each policy on a fresh 2-replica Serve application (cold caches), same workload."""
    import ray
    from ray import serve

    from radixserve.router.ray_serve import APP_NAME, build_app, wait_running

    # Two logical CPUs for the replicas (one each) and one for Ray's peer, whose prefix tree is
    # an actor of its own: it would never be placed beside two replicas on 2 CPUs.
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    options = {"model": None, "threads": 1, "kv_cache_tokens": args.kv_cache_tokens}
    rows = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for policy in args.policies.split(","):
            peer = {"router_class": RAY_PEER, "router_kwargs": {}} if policy == "ray_prefix" else {}
            app = build_app(options, 2, "precise" if peer else policy, **peer)
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
            wait_running(600)
            row = asyncio.run(run_rate(url, prompts, args.rate, args.output, seed=1))
            row["hit"] = row["usage_hit"]
            rows[policy] = row
            print_row(policy, row)
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows


def print_row(policy: str, row: dict) -> None:
    print(
        f"  {policy:<12} {row['req_s']:5.2f} req/s {row['tok_s']:6.1f} tok/s  "
        f"TTFT p50 {row['ttft50']:5.2f} p99 {row['ttft99']:5.2f} s  "
        f"hit {100 * row['hit']:5.1f}%",
        flush=True,
    )


def report(rows: dict) -> None:
    if "round_robin" not in rows:
        return
    rr = rows["round_robin"]
    for name, row in rows.items():
        if name != "round_robin":
            print(
                f"{name} / round_robin: throughput {row['tok_s'] / rr['tok_s']:.2f}x, "
                f"TTFT p50 {row['ttft50'] / rr['ttft50']:.2f}x, hit rate "
                f"{100 * row['hit']:.1f}% against {100 * rr['hit']:.1f}%"
            )


if __name__ == "__main__":
    main()
