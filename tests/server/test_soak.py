"""A bounded soak on loopback: mixed streaming and plain traffic for two minutes, with 30% of
clients disconnecting at random points. Afterwards nothing runs, nothing is locked, the KV pool
is whole, and the server's RSS grew by no more than 5% between minute one and minute two.

RADIXSERVE_SOAK_SECONDS shortens it for local runs (the RSS check needs at least 60).
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
from test_serve_cli import _metric, _start_server

SOAK_SECONDS = float(os.environ.get("RADIXSERVE_SOAK_SECONDS", "120"))
CLIENTS = 12
DISCONNECT_SHARE = 0.3


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: dict) -> None:
    prefix = " ".join(f"t{5 + (rng.randrange(4) * 7 + j) % 90}" for j in range(rng.choice([8, 40])))
    suffix = " ".join(f"t{rng.randrange(5, 95)}" for _ in range(rng.randrange(1, 12)))
    body = {
        "prompt": f"{prefix} {suffix}",
        "max_tokens": rng.randrange(1, 64),
        "temperature": rng.choice([0.0, 0.8]),
        "n": rng.choice([1, 1, 1, 2]),
    }
    disconnect = rng.random() < DISCONNECT_SHARE
    stream = rng.random() < 0.5
    chat = rng.random() < 0.3
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if chat:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    try:
        if stream:
            body["stream"] = True
            async with client.stream("POST", path, json=body) as response:
                cut = rng.randrange(1, 8) if disconnect else None
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data:")
                    if cut is not None and seen >= cut:
                        tally["disconnected"] += 1
                        return  # leaving the block closes the connection mid-stream
                    if '"error"' in line:
                        tally["errors"].append(line)
                tally[response.status_code] = tally.get(response.status_code, 0) + 1
        else:
            timeout = rng.uniform(0.005, 0.2) if disconnect else 60
            response = await client.post(path, json=body, timeout=timeout)
            tally[response.status_code] = tally.get(response.status_code, 0) + 1
            if response.status_code != 200:
                tally["errors"].append(response.text)
    except httpx.TimeoutException:
        tally["disconnected"] += 1


async def soak(url: str, pid: int, seconds: float) -> dict:
    tally: dict = {"errors": [], "disconnected": 0, "rss": {}}
    start = time.monotonic()

    async def client_loop(k: int) -> None:
        rng = random.Random(k)
        limits = httpx.Limits(max_connections=4)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            while time.monotonic() - start < seconds:
                await one_request(client, rng, tally)

    async def sample_rss() -> None:
        for minute in (1, 2):
            at = start + min(60 * minute, seconds) - 1
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            tally["rss"][minute] = rss_bytes(pid)

    await asyncio.gather(sample_rss(), *(client_loop(k) for k in range(CLIENTS)))
    return tally


def test_soak_with_random_disconnects_leaks_nothing(tiny_model_dir):
    proc, url = _start_server(
        tiny_model_dir, "--kv-cache-tokens", "2048", "--max-running-requests", "16"
    )
    try:
        tally = asyncio.run(soak(url, proc.pid, SOAK_SECONDS))
        print({k: v for k, v in tally.items() if k != "errors"})
        assert not tally["errors"], tally["errors"][:3]
        assert tally.get(200, 0) > 100 and tally["disconnected"] > 30, tally
        deadline = time.monotonic() + 10
        while _metric(url, "radixserve_running_requests") or _metric(
            url, "radixserve_queued_requests"
        ):
            assert time.monotonic() < deadline, "requests are still running after the soak"
            time.sleep(0.05)
        assert _metric(url, "radixserve_cache_protected_tokens") == 0
        available = _metric(url, "radixserve_kv_available_tokens")
        evictable = _metric(url, "radixserve_cache_evictable_tokens")
        assert available + evictable == _metric(url, "radixserve_kv_pool_tokens")
        assert httpx.get(f"{url}/health").status_code == 200
        if SOAK_SECONDS >= 60:
            first, second = tally["rss"][1], tally["rss"][2]
            assert second <= 1.05 * first, f"RSS grew {second / first - 1:.1%} in minute two"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
