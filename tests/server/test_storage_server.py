"""A server with a storage tier: /generate says how much of a prompt came from storage, and
/metrics counts the tier's pages and bytes."""

from __future__ import annotations

import re

import httpx
from conftest import LiveServer

from radixserve.engine import Engine

PROMPT = [3 + (7 * i) % 80 for i in range(40)]


def _generate(server: LiveServer) -> dict:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    reply = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert reply.status_code == 200
    return reply.json()["meta_info"]


def _counter(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.MULTILINE).group(1))


def test_storage_tier_through_the_server(tiny_model_dir, tmp_path):
    options = {"dtype": "float64", "hicache_storage": f"file:{tmp_path}", "hicache_page_size": 16}
    first = LiveServer(Engine(str(tiny_model_dir), **options))
    try:
        assert _generate(first)["storage_cached_tokens"] == 0
        first.engine.storage_io.flush(30)
        metrics = httpx.get(f"{first.url}/metrics", timeout=10).text
        assert _counter(metrics, 'radixserve_storage_pages_total{outcome="stored"}') == 2
        assert _counter(metrics, 'radixserve_storage_bytes_total{op="write"}') > 0
    finally:
        first.stop()
    second = LiveServer(Engine(str(tiny_model_dir), **options))
    try:
        meta = _generate(second)
        assert meta["storage_cached_tokens"] == 32 and meta["cached_tokens"] == 32
        metrics = httpx.get(f"{second.url}/metrics", timeout=10).text
        assert _counter(metrics, "radixserve_storage_loaded_tokens_total") == 32
        second.idle_check()
    finally:
        second.stop()
