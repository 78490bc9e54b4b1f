"""Replay a trace through the real Scheduler and RadixCache, with a cost model for time.

The replay is the engine's loop with the model replaced: `scheduler.step()`, the cost model
advances a simulated clock by the batch's duration, the "model" emits each request's next
answer token (the trace's `output_ids` where known, else a token of its own), and
`scheduler.process_batch_result()`. Both the scheduler and the cache read the simulated
clock, so LRU and the latency metrics see simulated time, and a replay is deterministic.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, is_dataclass

import numpy as np
from tqdm import tqdm

from radixserve.cache.allocator import PagedTokenToKVPoolAllocator
from radixserve.cache.evict import EvictionPolicy, make_eviction_policy
from radixserve.cache.radix import RadixCache
from radixserve.errors import InvalidArgumentError
from radixserve.sched.request import Req, SamplingParams, pages
from radixserve.sched.scheduler import Batch, ForwardMode, Scheduler, SchedulerConfig
from radixserve.sim.costmodel import CostModel
from radixserve.sim.oracle import BeladyPolicy, unique_tokens
from radixserve.sim.tiers import lab_tiers
from radixserve.sim.traces import TraceRequest

_SYNTHETIC_BASE = 2**30
PEAK_WINDOWS = 10  # the peak load is the busiest of this many equal parts of the span


@dataclass(frozen=True)
class ReplayConfig:
    """One replay's settings. Give the KV capacity as `kv_cache_tokens` or `cache_fraction`.

    `cache_fraction` is a share of the trace's unique tokens. A pool is never made smaller
    than the largest single request (prompt plus answer): below that the request could not
    run at all; the result records both the asked and the used capacity.
    """

    eviction_policy: str = "lru"
    schedule_policy: str = "fcfs"
    kv_cache_tokens: int | None = None
    cache_fraction: float | None = None
    page_size: int = 1
    arrivals: str = "trace"
    enable_radix_cache: bool = True
    max_running_requests: int = 256
    chunked_prefill_size: int = 8192
    scheduler_options: dict = field(default_factory=dict)
    cost_model: CostModel = field(default_factory=CostModel)
    check_invariants: bool = False
    host_cache_tokens: int = 0
    host_page_size: int | None = None
    host_eviction_policy: str = "lru"
    storage_cache_tokens: int = 0

    def __post_init__(self) -> None:
        check_capacity(self.kv_cache_tokens, self.cache_fraction, "kv_cache_tokens")
        check_page_size(self.page_size)
        parse_arrivals(self.arrivals)


def check_capacity(kv_tokens: int | None, cache_fraction: float | None, name: str) -> None:
    """Raise unless exactly one of a token count `name` (>= 1) and a percentage is given."""
    if (kv_tokens is None) == (cache_fraction is None):
        raise InvalidArgumentError(f"give exactly one of {name} and cache_fraction")
    if kv_tokens is not None and (not isinstance(kv_tokens, int) or kv_tokens < 1):
        raise InvalidArgumentError(f"{name} must be an integer >= 1, got {kv_tokens!r}")
    if cache_fraction is not None and not 0 < cache_fraction <= 100:
        raise InvalidArgumentError(f"cache_fraction must be in (0, 100], got {cache_fraction!r}")


def check_page_size(page_size: int) -> None:
    """Raise unless `page_size` is an integer >= 1."""
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise InvalidArgumentError(f"page_size must be an integer >= 1, got {page_size!r}")


def pool_size(
    kv_tokens: int | None, cache_fraction: float | None, unique: int, largest: int, page_size: int
) -> tuple[int, int]:
    """(asked, used) KV tokens: `kv_tokens`, or `cache_fraction` percent of `unique`. The pool
    used is never smaller than `largest`, the biggest request, which could not run at all."""
    check_page_size(page_size)
    asked = kv_tokens if kv_tokens is not None else max(1, round(cache_fraction / 100 * unique))
    return asked, pages(max(asked, largest), page_size)


def parse_arrivals(spec: str) -> tuple[str, float]:
    """('trace'|'burst'|'scaled'|'closed-loop', parameter) from an `arrivals` string.

    `trace`: the trace's timestamps. `burst`: everything at time 0. `scaled:X`: the trace's
    timestamps divided by X (X = 2 sends twice as fast). `closed-loop:N`: N clients, each
    sending the next request in trace order as soon as its last one ends; timestamps are
    ignored. A request with `after` still waits for that request in every mode.
    """
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"arrivals must be a string, got {spec!r}")
    kind, _, value = spec.partition(":")
    if kind in ("trace", "burst") and not value:
        return kind, 0.0
    try:
        number = float(value) if kind == "scaled" else int(value)
    except ValueError:
        number = 0
    if kind in ("scaled", "closed-loop") and number > 0 and math.isfinite(number):
        return kind, float(number)
    raise InvalidArgumentError(
        f"arrivals must be trace, burst, scaled:X (X > 0) or closed-loop:N (N >= 1), got {spec!r}"
    )


def offered_load(
    trace: Sequence[TraceRequest],
    cost_model: CostModel,
    arrivals: str,
    *,
    pool_keys: int | None = None,
    max_running_requests: int = 256,
    windows: int = 1,
) -> float:
    """Work without any reuse, in simulated seconds, over the span of the arrivals; with
    `windows` > 1, the span is cut into that many equal windows and the busiest one's work
    over its length is returned (the peak load).

    The work is every prompt's prefill and, given the KV pool (`pool_keys`, in the trace's
    keys), every answer's decode at the largest batch the pool and `max_running_requests`
    allow: as many average requests (prompt and answer) as the pool holds. Above 1 the
    simulated server cannot keep up even if it batched perfectly, unless the cache saves the
    difference: queues grow, and hit rates depend on scheduling as much as on eviction.
    Infinite for `burst`; nan for `closed-loop`, whose load follows the server.
    """
    kind, value = parse_arrivals(arrivals)
    if kind == "closed-loop":
        return math.nan
    k = tokens_per_key(trace)
    work = np.array([cost_model.prefill_time(k * len(r.input_ids), 0) for r in trace])
    if pool_keys is not None:
        footprint = sum(len(r.input_ids) + r.output_len for r in trace) / len(trace)
        batch = max(1.0, min(max_running_requests, pool_keys / max(footprint, 1.0)))
        for i, r in enumerate(trace):
            answer = r.output_len if r.answer_tokens is None else r.answer_tokens
            context = k * len(r.input_ids) + answer / 2
            per_token = (
                cost_model.decode_step / batch
                + cost_model.decode_per_request
                + cost_model.decode_per_context_token * context
            )
            work[i] += answer * per_token
    times = np.array([r.arrival for r in trace])
    span = (times.max() - times.min()) / (value if kind == "scaled" else 1.0)
    if kind == "burst" or span <= 0:
        return math.inf
    if windows <= 1:
        return float(work.sum() / span)
    where = np.minimum(((times - times.min()) / (times.max() - times.min()) * windows), windows - 1)
    per_window = np.bincount(where.astype(np.int64), weights=work, minlength=windows)
    return float(per_window.max() / (span / windows))


@dataclass
class ReplayResult:
    """What one replay measured. Times are simulated seconds unless named `wall`."""

    eviction_policy: str
    schedule_policy: str
    kv_tokens_requested: int
    kv_tokens: int
    cache_fraction: float
    requests: int
    failed: int
    token_hit_rate: float
    prompt_tokens: int
    cached_prompt_tokens: int
    prefill_tokens_computed: int
    prefill_computed_fraction: float
    output_tokens: int
    makespan: float
    throughput_tokens_per_s: float
    requests_per_s: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    e2e_p50: float
    e2e_p90: float
    e2e_p99: float
    queue_delay_p99: float
    evicted_tokens: int
    retractions: int
    offered_load: float
    """Prefill and decode work without reuse over the arrival span (`offered_load`)."""
    peak_load: float
    """The same over the busiest tenth of the span."""
    wall_seconds: float
    sched_cache_us_per_request: float
    host_cache_tokens: int = 0
    host_hit_tokens: int = 0
    host_hit_rate: float = 0.0
    """Prompt tokens (keys) loaded from the host tier, over all prompt tokens."""
    storage_cache_tokens: int = 0
    storage_hit_tokens: int = 0
    storage_hit_rate: float = 0.0
    """Prompt tokens (keys) loaded from the storage tier, over all prompt tokens."""
    policy_summary: dict | None = None
    """The eviction policy's own account at the end (`policy_summary`), where it gives one."""

    def as_dict(self) -> dict:
        return asdict(self)


def scripted_tokens(
    batch: Batch, trace: Sequence[TraceRequest], index: dict[str, int]
) -> list[int]:
    """The model of a replay: each request's next token is the trace's answer, or past its
    end a synthetic token no prompt uses."""
    out = []
    for entry in batch.entries:
        req = entry.req
        i, k = index[req.rid], len(req.output_ids)
        answer = trace[i].output_ids
        if answer is not None and k < len(answer):
            out.append(int(answer[k]))
        else:
            out.append(_SYNTHETIC_BASE + (i * 65_536 + k) % _SYNTHETIC_BASE)
    return out


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def make_policy(
    name: str, trace: Sequence[TraceRequest], page_size: int, *, whole_prompt: bool = False
) -> EvictionPolicy | BeladyPolicy:
    """A registered eviction policy, or the offline `belady` oracle for this trace.

    `whole_prompt` tells Belady that a request can reuse its whole prompt (pure cache
    simulation) rather than all of it but the last token (the scheduler's rule)."""
    if name == "belady":
        return BeladyPolicy(trace, page_size, whole_prompt=whole_prompt)
    return make_eviction_policy(name)


def policy_summary(policy: object) -> dict | None:
    """What a policy says of itself at the end of a run, as plain data: `summary()` of a
    policy that has one (`adaptive`: the expert it follows, its switches, its shadows'
    estimates), None for the others."""
    summary = getattr(policy, "summary", None)
    if not callable(summary):
        return None
    report = summary()
    return asdict(report) if is_dataclass(report) else dict(report)


_TOKEN_DENOMINATED = (
    "chunked_prefill_size",
    "in_batch_prefix_check_threshold",
    "in_batch_prefix_defer_threshold",
    "clip_max_new_tokens",
)


def scheduler_config(config: ReplayConfig, tokens_per_key: int = 1) -> SchedulerConfig:
    """The scheduler settings a replay's `config` names; limits given in tokens are converted
    to keys of `tokens_per_key` tokens (rounded up, at least 1)."""
    options = {
        "schedule_policy": config.schedule_policy,
        "max_running_requests": config.max_running_requests,
        "chunked_prefill_size": config.chunked_prefill_size,
        **config.scheduler_options,
    }
    if tokens_per_key > 1:
        for name in _TOKEN_DENOMINATED:
            if name in options and isinstance(options[name], int) and options[name] > 0:
                options[name] = -(-options[name] // tokens_per_key)
            elif name not in options:
                default = getattr(SchedulerConfig, name)
                options[name] = max(1, -(-default // tokens_per_key))
    return SchedulerConfig(**options)


def tokens_per_key(trace: Sequence[TraceRequest]) -> int:
    """The tokens one key of `trace` stands for (block keys), which all its requests share."""
    sizes = {r.key_tokens for r in trace}
    if len(sizes) != 1:
        raise InvalidArgumentError(f"a trace mixes keys of {sorted(sizes)} tokens")
    return sizes.pop()


def batch_seconds(
    cost_model: CostModel,
    batch: Batch,
    trace: Sequence[TraceRequest],
    index: dict[str, int],
    key_tokens: int = 1,
) -> float:
    """Simulated seconds of `batch`. With block keys a decoded key is charged the tokens of
    the answer it holds: the first key (the prefill's) one token, each later one up to
    `key_tokens`, the last what is left of the trace's `answer_tokens`."""
    if key_tokens == 1 or batch.mode is ForwardMode.EXTEND:
        return cost_model.batch_time(batch, key_tokens)
    steps = []
    for entry in batch.entries:
        answer = trace[index[entry.req.rid]].answer_tokens
        before = 1 + (len(entry.req.output_ids) - 1) * key_tokens  # tokens of earlier keys
        left = key_tokens if answer is None else answer - before
        steps.append(max(1, min(key_tokens, left)))
    return cost_model.batch_time(batch, key_tokens, steps)


def trace_index(trace: Sequence[TraceRequest]) -> dict[str, int]:
    """Request id -> position in `trace`; raises when ids repeat."""
    index = {r.rid: i for i, r in enumerate(trace)}
    if len(index) != len(trace):
        raise InvalidArgumentError("trace request ids must be unique")
    return index


def arrival_times(trace: Sequence[TraceRequest], kind: str, value: float) -> list[float]:
    """When each request is sent under arrivals `kind` (`parse_arrivals`); closed-loop
    requests are all ready at 0 and wait for a free client."""
    if kind in ("burst", "closed-loop"):
        return [0.0] * len(trace)
    return [r.arrival / value if kind == "scaled" else r.arrival for r in trace]


def dependency_queue(
    trace: Sequence[TraceRequest], arrivals: Sequence[float], index: dict[str, int]
) -> tuple[list[tuple[float, int]], dict[str, list[int]]]:
    """(heap of (send time, position) ready now, rid -> positions sent once it ends)."""
    ready: list[tuple[float, int]] = []
    blocked: dict[str, list[int]] = {}
    for i, r in enumerate(trace):
        if r.after is None:
            ready.append((arrivals[i], i))
        elif r.after not in index or r.after == r.rid:
            raise InvalidArgumentError(f"request {r.rid}: after={r.after!r} names no other request")
        else:
            blocked.setdefault(r.after, []).append(i)
    heapq.heapify(ready)
    return ready, blocked


@dataclass
class Outcomes:
    """What the finished requests of a replay add up to (times in simulated seconds)."""

    failed: int = 0
    output_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)

    def record(self, req: Req, answer_tokens: int | None = None) -> None:
        """Count finished `req`; `answer_tokens`, where given, is its answer's length in
        tokens (block keys), else its output ids are."""
        if req.finish_reason.kind == "abort":
            self.failed += 1
            return
        self.output_tokens += len(req.output_ids) if answer_tokens is None else answer_tokens
        self.e2e.append(req.finish_time - req.arrival_time)
        if req.first_token_time is not None:
            self.ttft.append(req.first_token_time - req.arrival_time)
        self.queue.append(req.first_scheduled_time - req.arrival_time)


def trace_req(r: TraceRequest, sent_at: float) -> Req:
    """The scheduler's request for trace request `r`, sent at `sent_at`."""
    return Req(
        r.rid,
        r.input_ids,
        SamplingParams(max_new_tokens=r.output_len, ignore_eos=True),
        priority=r.priority,
        arrival_time=sent_at,
    )


def replay(
    trace: Sequence[TraceRequest],
    config: ReplayConfig,
    *,
    unique: int | None = None,
    progress: bool = False,
) -> ReplayResult:
    """Serve `trace` under `config` and measure it. `unique` may pass a precomputed
    `unique_tokens(trace)` when sizing the cache by fraction.

    With block keys (`TraceRequest.key_tokens` > 1) the pool (`kv_cache_tokens`), the hit
    rate and the result's prompt, cache and eviction counts are in blocks, a partial last block
    counting whole; the scheduler's token limits are converted to blocks; the cost model and
    the output token count see the real tokens.
    """
    if not trace:
        raise InvalidArgumentError("the trace is empty")
    k = tokens_per_key(trace)
    if unique is None:
        unique = unique_tokens(trace)
    largest = max(len(r.input_ids) + r.output_len for r in trace)
    asked, kv_tokens = pool_size(
        config.kv_cache_tokens, config.cache_fraction, unique, largest, config.page_size
    )
    now = [0.0]

    def clock() -> float:
        return now[0]

    policy = make_policy(config.eviction_policy, trace, config.page_size)
    allocator = PagedTokenToKVPoolAllocator(kv_tokens, config.page_size)
    cache = RadixCache(
        allocator,
        page_size=config.page_size,
        eviction_policy=policy,
        disable=not config.enable_radix_cache,
        clock=clock,
    )
    on_admit = None
    if isinstance(policy, BeladyPolicy):
        on_admit = policy.on_admit
    scheduler = Scheduler(cache, scheduler_config(config, k), clock=clock, on_admit=on_admit)
    cost = config.cost_model

    def storage_worth(tokens: int, prefix: int) -> bool:
        """Whether reading `tokens` keys from storage beats recomputing them."""
        return cost.tier_load_time(0, k * tokens) < cost.prefill_time(k * tokens, k * prefix)

    tiers = lab_tiers(
        cache,
        config.host_cache_tokens,
        config.storage_cache_tokens,
        config.host_page_size,
        config.host_eviction_policy,
        storage_worth,
    )
    if tiers is not None:  # as the engine does: before a request's first admission
        scheduler.before_admit = lambda req: tiers.load(req.token_ids(req.seq_len - 1))
    charged = [0, 0]  # host and storage keys whose load time is already on the clock
    index = trace_index(trace)
    kind, value = parse_arrivals(config.arrivals)
    arrivals = arrival_times(trace, kind, value)
    clients = int(value) if kind == "closed-loop" else None
    in_flight = 0
    ready, blocked = dependency_queue(trace, arrivals, index)
    outcomes = Outcomes()
    sent = 0
    wall = 0.0
    n = len(trace)
    bar = tqdm(total=n, desc="replay", unit="req", disable=not progress, leave=False)
    started = time.perf_counter()
    while sent < n or scheduler.has_work():
        tick = time.perf_counter()
        while ready and ready[0][0] <= now[0] and (clients is None or in_flight < clients):
            sent_at, i = heapq.heappop(ready)
            if clients is not None:  # a closed-loop client sends when its last request ends
                sent_at = now[0]
            in_flight += 1
            scheduler.add_request(trace_req(trace[i], sent_at))
            sent += 1
        batch = scheduler.step() if scheduler.has_work() else None
        wall += time.perf_counter() - tick
        if tiers is not None:
            host = tiers.host_hit_tokens - charged[0]
            storage = tiers.storage_hit_tokens - charged[1]
            now[0] += cost.tier_load_time(host * k, storage * k)
            charged[:] = tiers.host_hit_tokens, tiers.storage_hit_tokens
        if batch is not None:
            now[0] += batch_seconds(config.cost_model, batch, trace, index, k)
            tokens = scripted_tokens(batch, trace, index)
            tick = time.perf_counter()
            scheduler.process_batch_result(batch, tokens)
            wall += time.perf_counter() - tick
            if config.check_invariants:
                scheduler.check_invariants()
                if tiers is not None:
                    tiers.check_invariants()
        finished = scheduler.pop_finished()
        for req in finished:
            bar.update(1)
            in_flight -= 1
            for child in blocked.pop(req.rid, ()):
                heapq.heappush(ready, (max(arrivals[child], now[0]), child))
            outcomes.record(req, trace[index[req.rid]].answer_tokens)
            if tiers is not None:
                tiers.finished(req.token_ids())
        if batch is None and not finished:
            if ready and (clients is None or in_flight < clients):
                now[0] = max(now[0], ready[0][0])
            elif scheduler.has_work():
                raise RuntimeError("the scheduler stalled with work queued")  # a bug, not input
            elif sent < n:
                raise InvalidArgumentError(
                    f"{n - sent} requests wait on an `after` that never finishes (a cycle?)"
                )
    bar.close()
    elapsed = time.perf_counter() - started
    stats = scheduler.stats
    makespan = now[0] - min(arrivals)

    def load(windows: int = 1) -> float:
        return offered_load(
            trace,
            config.cost_model,
            config.arrivals,
            pool_keys=kv_tokens,
            max_running_requests=config.max_running_requests,
            windows=windows,
        )

    return ReplayResult(
        eviction_policy=config.eviction_policy,
        schedule_policy=config.schedule_policy,
        kv_tokens_requested=asked,
        kv_tokens=kv_tokens,
        cache_fraction=kv_tokens / unique if unique else math.nan,
        requests=n,
        failed=outcomes.failed,
        token_hit_rate=stats.cached_prompt_tokens / max(1, stats.prompt_tokens),
        prompt_tokens=stats.prompt_tokens,
        cached_prompt_tokens=stats.cached_prompt_tokens,
        prefill_tokens_computed=stats.computed_prefill_tokens,
        prefill_computed_fraction=stats.computed_prefill_tokens / max(1, stats.prompt_tokens),
        output_tokens=outcomes.output_tokens,
        makespan=makespan,
        throughput_tokens_per_s=outcomes.output_tokens / makespan if makespan > 0 else math.nan,
        requests_per_s=(n - outcomes.failed) / makespan if makespan > 0 else math.nan,
        ttft_p50=percentile(outcomes.ttft, 50),
        ttft_p90=percentile(outcomes.ttft, 90),
        ttft_p99=percentile(outcomes.ttft, 99),
        e2e_p50=percentile(outcomes.e2e, 50),
        e2e_p90=percentile(outcomes.e2e, 90),
        e2e_p99=percentile(outcomes.e2e, 99),
        queue_delay_p99=percentile(outcomes.queue, 99),
        evicted_tokens=stats.evicted_tokens,
        retractions=stats.retractions,
        offered_load=load(),
        peak_load=load(windows=PEAK_WINDOWS),
        wall_seconds=elapsed,
        sched_cache_us_per_request=wall / n * 1e6,
        host_cache_tokens=config.host_cache_tokens,
        host_hit_tokens=charged[0],
        host_hit_rate=charged[0] / max(1, stats.prompt_tokens),
        storage_cache_tokens=config.storage_cache_tokens,
        storage_hit_tokens=charged[1],
        storage_hit_rate=charged[1] / max(1, stats.prompt_tokens),
        policy_summary=policy_summary(policy),
    )
