"""Prometheus metrics of the server: requests, tokens, the radix cache, queues, latency, health.

Each server has its own registry (no global state). Counters and histograms are fed by the
engine thread as chunks come out; sizes, queue lengths and engine health are read at scrape
time from the snapshot the engine thread publishes, never from the engine itself.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from radixserve.engine import StreamChunk

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineState:
    """Reads the worker's latest `EngineSnapshot` when Prometheus scrapes."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def collect(self):
        worker = self.worker
        snap = worker.snapshot
        stats = snap.stats
        healthy, details = worker.health()
        gauges = (
            (
                "radixserve_cache_evictable_tokens",
                "Tokens in unlocked tree nodes.",
                snap.cache_evictable,
            ),
            (
                "radixserve_cache_protected_tokens",
                "Tokens in locked tree nodes.",
                snap.cache_protected,
            ),
            ("radixserve_kv_available_tokens", "Free KV slots.", snap.kv_available),
            ("radixserve_kv_pool_tokens", "KV slots in the pool.", snap.kv_pool),
            ("radixserve_running_requests", "Requests decoding or prefilling.", snap.running),
            ("radixserve_queued_requests", "Requests waiting to be admitted.", snap.waiting),
            (
                "radixserve_cache_hit_rate",
                "Cached / total prompt tokens at first admission.",
                stats.cached_prompt_tokens / max(1, stats.prompt_tokens),
            ),
            ("radixserve_engine_up", "1 while the engine thread serves and is healthy.", healthy),
            (
                "radixserve_engine_seconds_since_progress",
                "Seconds since the engine loop last made progress.",
                details["seconds_since_progress"],
            ),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=float(value))
        counters = (
            ("radixserve_prompt_tokens", "Prompt tokens admitted.", stats.prompt_tokens),
            (
                "radixserve_cached_prompt_tokens",
                "Prompt tokens served from the radix cache.",
                stats.cached_prompt_tokens,
            ),
            (
                "radixserve_prefill_tokens_computed",
                "Prefill tokens the model computed.",
                stats.computed_prefill_tokens,
            ),
            (
                "radixserve_retractions",
                "Decode requests retracted under memory pressure.",
                stats.retractions,
            ),
            (
                "radixserve_evicted_tokens",
                "Tokens evicted from the radix cache.",
                stats.evicted_tokens,
            ),
            (
                "radixserve_engine_failed_steps",
                "Engine steps that failed (their batch's requests were aborted).",
                snap.failed_steps,
            ),
            (
                "radixserve_engine_failures",
                "Engine thread deaths (the server exits after one).",
                int(worker.failure is not None),
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        if snap.eviction is not None:
            yield from _eviction_families(snap.eviction)
        engine = worker.engine
        tiers = [("host", getattr(engine, "host_tier", None))]
        storage_io = getattr(engine, "storage_io", None)
        tiers.append(("storage", storage_io.tier if storage_io is not None else None))
        for name, tier in tiers:
            if tier is not None:
                yield from _tier_families(name, tier)


def _eviction_families(summary):
    """`adaptive`'s report (an `AdaptiveSummary`): what it follows, what its shadows estimate."""
    following = GaugeMetricFamily(
        "radixserve_eviction_following",
        "1 for the order the adaptive eviction policy evicts in now.",
        labels=["expert"],
    )
    for expert in ("learned-lru", "lru", "lfu", "wgd"):
        following.add_metric([expert], float(summary.following == expert))
    yield following
    estimates = GaugeMetricFamily(
        "radixserve_eviction_estimated_hit_rate",
        "Hit rate on the sampled blocks over the latest epochs: the cache's own (tree) and what "
        "each shadow policy would have hit at this cache's size.",
        labels=["policy"],
    )
    for policy, rate in summary.estimated_hit_rates.items():
        estimates.add_metric([policy], rate)
    yield estimates
    counters = (
        ("radixserve_eviction_switches", "Switches between eviction experts.", summary.switches),
        (
            "radixserve_eviction_sampled_references",
            "Block references the eviction shadows have seen.",
            summary.sampled_references,
        ),
    )
    for name, doc, value in counters:
        yield CounterMetricFamily(name, doc, value=value)
    gauges = (
        (
            "radixserve_eviction_sample_rate",
            "Share of blocks the shadows sample.",
            summary.sample_rate,
        ),
        (
            "radixserve_eviction_shadow_entries",
            "Block names held by the shadows and their ghosts.",
            summary.shadow_entries,
        ),
        (
            "radixserve_eviction_node_records",
            "Tree nodes the adaptive policy keeps a record of.",
            summary.node_records,
        ),
    )
    for name, doc, value in gauges:
        yield GaugeMetricFamily(name, doc, value=float(value))


def _tier_families(name: str, tier):
    """A KV tier's counters (plain ints its threads bump; read as they stand)."""
    stats = tier.storage.stats
    pages = CounterMetricFamily(
        f"radixserve_{name}_pages", f"KV {name} tier pages by outcome.", labels=["outcome"]
    )
    for outcome in ("hits", "misses", "rejected", "stored", "evicted", "write_errors"):
        pages.add_metric([outcome], getattr(stats, outcome))
    yield pages
    moved = CounterMetricFamily(
        f"radixserve_{name}_bytes",
        f"KV bytes read from and written to the {name} tier.",
        labels=["op"],
    )
    moved.add_metric(["read"], stats.bytes_read)
    moved.add_metric(["write"], stats.bytes_written)
    yield moved
    yield CounterMetricFamily(
        f"radixserve_{name}_loaded_tokens",
        f"Prompt tokens loaded from the {name} tier into the radix cache instead of computed.",
        value=tier.loaded_tokens,
    )
    for what, histogram in (("load", tier.load_latency), ("backup", tier.backup_latency)):
        buckets, total = histogram.snapshot()
        family = HistogramMetricFamily(
            f"radixserve_{name}_{what}_seconds",
            f"Seconds per {what} of KV pages {'from' if what == 'load' else 'to'} the {name} tier.",
        )
        family.add_metric([], buckets, total)
        yield family
    size = getattr(tier.storage, "size_bytes", None)
    if size is not None:
        yield GaugeMetricFamily(
            f"radixserve_{name}_size_bytes", f"Bytes the {name} tier holds.", value=size()
        )


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "radixserve_requests",
            "Finished requests by finish reason (an abort by its cause).",
            ["finish_reason"],
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "radixserve_generation_tokens", "Tokens generated.", registry=self.registry
        )
        self.ttft = Histogram(
            "radixserve_time_to_first_token_seconds",
            "Time to first token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "radixserve_inter_token_latency_seconds",
            "Time between tokens of a request.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def watch(self, worker) -> None:
        """Report `worker`'s engine snapshot and health at every scrape."""
        self.registry.register(_EngineState(worker))

    def on_chunk(self, chunk: StreamChunk, stream, now: float) -> None:
        """Called on the engine thread for every chunk before it is handed to the client."""
        if chunk.token_ids:
            self.generation_tokens.inc(len(chunk.token_ids))
            if stream.last_token_time is None:
                self.ttft.observe(now - stream.submitted)
            else:
                self.itl.observe((now - stream.last_token_time) / len(chunk.token_ids))
        if chunk.finished and chunk.result is not None:
            result = chunk.result
            label = result.abort_cause if result.finish_reason == "abort" else result.finish_reason
            self.requests.labels(label or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
