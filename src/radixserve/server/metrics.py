"""Prometheus metrics of the server: requests, tokens, the radix cache, queues and latency.

Each server has its own registry (no global state). Counters and histograms are fed by the
engine thread as chunks come out; cache sizes and queue lengths are read at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixserve.engine import Engine, StreamChunk

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineState:
    """Reads the engine's live sizes and counters when Prometheus scrapes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        engine, stats = self.engine, self.engine.scheduler.stats
        cache = engine.cache
        for name, doc, value in (
            (
                "radixserve_cache_evictable_tokens",
                "Tokens in unlocked tree nodes.",
                cache.evictable_size(),
            ),
            (
                "radixserve_cache_protected_tokens",
                "Tokens in locked tree nodes.",
                cache.protected_size(),
            ),
            ("radixserve_kv_available_tokens", "Free KV slots.", engine.allocator.available_size()),
            (
                "radixserve_running_requests",
                "Requests decoding or prefilling.",
                len(engine.scheduler.running) + (engine.scheduler.prefilling is not None),
            ),
            (
                "radixserve_queued_requests",
                "Requests waiting to be admitted.",
                len(engine.scheduler.waiting),
            ),
            (
                "radixserve_cache_hit_rate",
                "Cached / total prompt tokens at first admission.",
                stats.cached_prompt_tokens / max(1, stats.prompt_tokens),
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
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
        ):
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(engine))
        self.requests = Counter(
            "radixserve_requests",
            "Finished requests by finish reason.",
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

    def on_chunk(self, chunk: StreamChunk, stream, now: float) -> None:
        """Called on the engine thread for every chunk before it is handed to the client."""
        if chunk.token_ids:
            self.generation_tokens.inc(len(chunk.token_ids))
            if stream.last_token_time is None:
                self.ttft.observe(now - stream.submitted)
            else:
                self.itl.observe((now - stream.last_token_time) / len(chunk.token_ids))
        if chunk.finished and chunk.result is not None:
            self.requests.labels(chunk.result.finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
