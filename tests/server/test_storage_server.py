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
        assert _counter(metrics, "radixserve_storage_backup_seconds_count") >= 1
    finally:
        first.stop()
    second = LiveServer(Engine(str(tiny_model_dir), **options))
    try:
        meta = _generate(second)
        assert meta["storage_cached_tokens"] == 32 and meta["cached_tokens"] == 32
        metrics = httpx.get(f"{second.url}/metrics", timeout=10).text
        assert _counter(metrics, "radixserve_storage_loaded_tokens_total") == 32
        assert _counter(metrics, "radixserve_storage_load_seconds_count") == 1
        assert _counter(metrics, 'radixserve_storage_load_seconds_bucket{le="+Inf"}') == 1
        second.idle_check()
        flushed = httpx.post(f"{second.url}/flush_cache", params={"scope": "storage"}).json()
        assert flushed == {"flushed_storage_pages": 2}
        assert not list(tmp_path.rglob("*.kv"))
        assert second.engine.cache.total_size() > 0  # the device tier is another scope
        _generate(second)  # the same prefix again: its pages go back to storage
        second.engine.storage_io.flush(30)
        assert len(list(tmp_path.rglob("*.kv"))) == 2
    finally:
        second.stop()


def test_host_tier_through_the_server(tiny_model_dir):
    engine = Engine(
        str(tiny_model_dir),
        dtype="float64",
        kv_cache_tokens=160,
        hicache_size_gb=0.01,
        hicache_page_size=16,
        hicache_write_policy="write_back",
    )
    server = LiveServer(engine)
    try:
        prompts = [[3 + (k * 7 + 13 * i) % 80 for i in range(100)] for k in range(3)]

        def generate(ids):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3}}
            reply = httpx.post(f"{server.url}/generate", json=body, timeout=60)
            assert reply.status_code == 200
            return reply.json()["meta_info"]

        for ids in prompts:  # the third pushes the first out of the 160-token device pool
            generate(ids)
        assert generate(prompts[0])["host_cached_tokens"] == 96
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert _counter(metrics, "radixserve_host_loaded_tokens_total") == 96
        assert _counter(metrics, "radixserve_host_size_bytes") > 0
        server.idle_check()
        bad = httpx.post(f"{server.url}/flush_cache", params={"scope": "disk"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "scope"
        flushed = httpx.post(f"{server.url}/flush_cache", params={"scope": "all"}).json()
        assert flushed["flushed_host_pages"] > 0 and flushed["flushed_tokens"] > 0
        assert "flushed_storage_pages" not in flushed  # this server has no storage tier
        assert len(engine.host_tier.storage) == 0
    finally:
        server.stop()
