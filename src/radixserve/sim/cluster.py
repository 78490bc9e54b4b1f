"""The lab with N replicas: a trace served by N Scheduler + RadixCache pairs under a router.

Each replica is the code the server runs (its own KV pool, tree and scheduler) on its own
simulated clock; the cost model says how long each of its batches takes. Arrivals are routed
when they arrive by a `radixserve.sched.routing` policy, which sees every replica's queue and,
for `precise`, the KV events its tree publishes after each step. A request that quotes an
earlier answer (`after`) is sent when that answer ends, as in the single-replica replay.

    from radixserve.sim.cluster import replay_cluster
    result = replay_cluster(trace, ReplayConfig(kv_cache_tokens=50_000), replicas=4,
                            router="precise")
    result.token_hit_rate, result.ttft_p99, result.imbalance
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from radixserve.cache.allocator import PagedTokenToKVPoolAllocator
from radixserve.cache.radix import RadixCache
from radixserve.errors import InvalidArgumentError
from radixserve.sched.routing import ReplicaLoad, RouteRequest, make_routing_policy
from radixserve.sched.scheduler import Scheduler
from radixserve.sim.oracle import unique_tokens
from radixserve.sim.replay import (
    Outcomes,
    ReplayConfig,
    arrival_times,
    batch_seconds,
    dependency_queue,
    parse_arrivals,
    percentile,
    pool_size,
    scheduler_config,
    scripted_tokens,
    tokens_per_key,
    trace_index,
    trace_req,
)
from radixserve.sim.traces import TraceRequest


@dataclass
class ClusterResult:
    """What one multi-replica replay measured (simulated seconds)."""

    router: str
    replicas: int
    kv_tokens_per_replica: int
    requests: int
    failed: int
    token_hit_rate: float
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    makespan: float
    throughput_tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    e2e_p50: float
    e2e_p99: float
    imbalance: float
    """max / mean of the replicas' busy time: 1.0 is perfectly even."""
    requests_per_replica: list[int]
    wall_seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


class _Replica:
    def __init__(self, config: ReplayConfig, kv_tokens: int, events: bool, key_tokens: int) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.routed = 0
        allocator = PagedTokenToKVPoolAllocator(kv_tokens, config.page_size)
        self.cache = RadixCache(
            allocator,
            page_size=config.page_size,
            eviction_policy=config.eviction_policy,
            disable=not config.enable_radix_cache,
            enable_kv_events=events,
            clock=self.clock,
        )
        self.scheduler = Scheduler(
            self.cache, scheduler_config(config, key_tokens), clock=self.clock
        )

    def clock(self) -> float:
        return self.now

    def load(self, now: float) -> ReplicaLoad:
        sched = self.scheduler
        tokens, oldest = 0, now
        for req in sched.waiting:
            tokens += len(req.input_ids)
            oldest = min(oldest, req.queued_time)
        running = len(sched.running) + (sched.prefilling is not None)
        return ReplicaLoad(len(sched.waiting), tokens, running, max(0.0, now - oldest))


def replay_cluster(
    trace: Sequence[TraceRequest],
    config: ReplayConfig,
    replicas: int,
    router: str,
    router_options: dict | None = None,
    *,
    unique: int | None = None,
) -> ClusterResult:
    """Serve `trace` on `replicas` simulated replicas, each with the KV pool `config` sizes,
    routed by `router`. Closed-loop arrivals are not supported here."""
    if not trace:
        raise InvalidArgumentError("the trace is empty")
    kind, value = parse_arrivals(config.arrivals)
    if kind == "closed-loop":
        raise InvalidArgumentError("--arrivals closed-loop is not supported with --replicas")
    if unique is None:
        unique = unique_tokens(trace)
    largest = max(len(r.input_ids) + r.output_len for r in trace)
    _, kv_tokens = pool_size(
        config.kv_cache_tokens, config.cache_fraction, unique, largest, config.page_size
    )
    policy = make_routing_policy(
        router, replicas, page_size=config.page_size, **(router_options or {})
    )
    events = router == "precise"
    key_tokens = tokens_per_key(trace)
    nodes = [_Replica(config, kv_tokens, events, key_tokens) for _ in range(replicas)]
    index = trace_index(trace)
    arrivals = arrival_times(trace, kind, value)
    ready, blocked = dependency_queue(trace, arrivals, index)
    outcomes = Outcomes()
    done = 0
    started = time.perf_counter()
    n = len(trace)
    while done < n:
        busy = [k for k, node in enumerate(nodes) if node.scheduler.has_work()]
        step_at = min((nodes[k].now for k in busy), default=math.inf)
        if ready and ready[0][0] <= step_at:
            at, i = heapq.heappop(ready)
            r = trace[i]
            loads = [node.load(at) for node in nodes]
            k = policy.choose(RouteRequest(r.input_ids), loads)
            node = nodes[k]
            node.routed += 1
            if not node.scheduler.has_work():
                node.now = max(node.now, at)
            node.scheduler.add_request(trace_req(r, at))
        elif busy:
            k = min(busy, key=lambda j: nodes[j].now)
            node = nodes[k]
            batch = node.scheduler.step()
            if batch is not None:
                took = batch_seconds(config.cost_model, batch, trace, index, key_tokens)
                node.now += took
                node.busy += took
                node.scheduler.process_batch_result(batch, scripted_tokens(batch, trace, index))
                if config.check_invariants:
                    node.scheduler.check_invariants()
            if events:
                policy.on_events(k, node.cache.take_events())
            finished = node.scheduler.pop_finished()
            if batch is None and not finished:
                raise RuntimeError("a replica stalled with work queued")  # a bug, not input
            for req in finished:
                done += 1
                for child in blocked.pop(req.rid, ()):
                    heapq.heappush(ready, (max(arrivals[child], node.now), child))
                outcomes.record(req, trace[index[req.rid]].answer_tokens)
        else:
            raise InvalidArgumentError(
                f"{n - done} requests wait on an `after` that never finishes (a cycle?)"
            )
    prompt = sum(node.scheduler.stats.prompt_tokens for node in nodes)
    cached = sum(node.scheduler.stats.cached_prompt_tokens for node in nodes)
    makespan = max(node.now for node in nodes) - min(arrivals)
    busy_times = [node.busy for node in nodes]
    mean_busy = sum(busy_times) / replicas
    return ClusterResult(
        router=router,
        replicas=replicas,
        kv_tokens_per_replica=kv_tokens,
        requests=n,
        failed=outcomes.failed,
        token_hit_rate=cached / max(1, prompt),
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        output_tokens=outcomes.output_tokens,
        makespan=makespan,
        throughput_tokens_per_s=outcomes.output_tokens / makespan if makespan > 0 else math.nan,
        ttft_p50=percentile(outcomes.ttft, 50),
        ttft_p99=percentile(outcomes.ttft, 99),
        e2e_p50=percentile(outcomes.e2e, 50),
        e2e_p99=percentile(outcomes.e2e, 99),
        imbalance=max(busy_times) / mean_busy if mean_busy > 0 else 1.0,
        requests_per_replica=[node.routed for node in nodes],
        wall_seconds=time.perf_counter() - started,
    )


def cluster_table(results: Sequence[ClusterResult], server_bound: float, cache_bound: float) -> str:
    """A markdown table of `results`, then two rows for N x the capacity in one place: one
    server serving everything (its running requests hold KV too), and the pure cache in
    arrival order (no scheduler: the hit rate's bound)."""
    lines = [
        "| router | replicas | hit rate | throughput tok/s | TTFT p50 s | TTFT p99 s | "
        "imbalance | requests per replica |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.router} | {r.replicas} | {r.token_hit_rate:.1%} | "
            f"{r.throughput_tokens_per_s:,.0f} | {r.ttft_p50:.3f} | {r.ttft_p99:.3f} | "
            f"{r.imbalance:.2f} | {r.requests_per_replica} |"
        )
    if results:
        n = results[0].replicas
        lines.append(f"| one server, {n}x the pool | 1 | {server_bound:.1%} | | | | | |")
        lines.append(f"| pure cache, {n}x the pool (bound) | - | {cache_bound:.1%} | | | | | |")
    return "\n".join(lines)


def plot_replica_sweep(path, results: Sequence[ClusterResult], title: str = "") -> None:
    """Hit rate against replica count, one line per router."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for router in dict.fromkeys(r.router for r in results):
        rows = sorted((r.replicas, r.token_hit_rate) for r in results if r.router == router)
        ax.plot([x for x, _ in rows], [100 * y for _, y in rows], marker="o", label=router)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replicas (each with the same KV pool)")
    ax.set_ylabel("prompt tokens from cache (%)")
    ax.set_title(title or "hit rate by replica count")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
