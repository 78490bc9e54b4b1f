"""A server under the adaptive eviction policy reports on /metrics what it follows and what
its shadows estimate each policy would hit."""

from __future__ import annotations

import re

import httpx
from conftest import LiveServer

from radixserve.engine import Engine


def _value(text: str, name: str) -> float | None:
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def test_adaptive_reports_its_expert_and_estimates(tiny_model_dir):
    engine = Engine(
        str(tiny_model_dir), dtype="float64", kv_cache_tokens=256, eviction_policy="adaptive"
    )
    server = LiveServer(engine)
    try:
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert _value(metrics, 'radixserve_eviction_following{expert="learned-lru"}') == 1.0
        assert _value(metrics, 'radixserve_eviction_following{expert="lfu"}') == 0.0
        assert _value(metrics, "radixserve_eviction_switches_total") == 0.0
        assert _value(metrics, "radixserve_eviction_sample_rate") == 1.0
        assert "radixserve_eviction_estimated_hit_rate{" not in metrics, "no epoch yet"
        # Three shared prefixes and distinct tails: hits and misses in a 256-token pool.
        for i in range(60):
            prefix = [5 + (i % 3) * 20 + j % 17 for j in range(24)]
            ids = prefix + [3 + (11 * i + 5 * j) % 90 for j in range(16)]
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
            assert httpx.post(f"{server.url}/generate", json=body, timeout=60).status_code == 200
        server.idle_check()
        summary = engine.cache.policy.summary()
        assert summary.epochs >= 1
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        sampled = _value(metrics, "radixserve_eviction_sampled_references_total")
        assert sampled == summary.sampled_references > 0
        for policy in ("tree", "lru", "lfu", "learned-lru"):
            rate = _value(metrics, f'radixserve_eviction_estimated_hit_rate{{policy="{policy}"}}')
            assert rate == summary.estimated_hit_rates[policy]
            assert 0.0 <= rate <= 1.0
        assert _value(metrics, "radixserve_eviction_shadow_entries") > 0
    finally:
        server.stop()


def test_other_policies_report_no_eviction_metrics(tiny_model_dir):
    server = LiveServer(Engine(str(tiny_model_dir), dtype="float64", eviction_policy="lfu"))
    try:
        assert "radixserve_eviction_" not in httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        server.stop()
