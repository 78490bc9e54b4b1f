"""The HTTP router over two live backends: `precise` sends a shared prefix where its KV is,
streams pass through, and a backend that goes away is routed around."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import LiveServer

from radixserve.engine import Engine
from radixserve.model.loader import load_tokenizer
from radixserve.sched.routing import RouteRequest

pytest.importorskip("zmq", reason="the precise router follows KV events (events extra)")

from radixserve.router.app import create_router_app


def _endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


class _Serve:
    """A router app on loopback in a thread."""

    def __init__(self, app) -> None:
        import uvicorn

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture()
def cluster(tiny_model_dir):
    endpoints = [_endpoint(), _endpoint()]
    backends = [
        LiveServer(Engine(str(tiny_model_dir), enable_kv_events=True), kv_events_endpoint=ep)
        for ep in endpoints
    ]
    app = create_router_app(
        [b.url for b in backends], "precise", load_tokenizer(tiny_model_dir), endpoints
    )
    router = _Serve(app)
    time.sleep(0.5)  # the event subscriptions connect
    yield router, backends, app
    router.stop()
    for b in backends:
        b.stop()


SHARED = " ".join(f"t{i % 90 + 3}" for i in range(120))


def test_precise_sends_a_shared_prefix_where_its_kv_is(cluster):
    router, backends, _ = cluster
    first = httpx.post(
        f"{router.url}/v1/completions",
        json={"prompt": SHARED + " t1", "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    assert first.status_code == 200
    time.sleep(0.5)  # the backend's events reach the router
    home = [b["routed"] for b in httpx.get(f"{router.url}/router/stats").json()["backends"]]
    for k in range(6):
        body = {"prompt": f"{SHARED} t{k + 4} t{k + 5}", "max_tokens": 2, "temperature": 0}
        reply = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 120
    routed = [b["routed"] for b in httpx.get(f"{router.url}/router/stats").json()["backends"]]
    assert routed[home.index(1)] == 7 and sum(routed) == 7
    for b in backends:
        b.idle_check()


def test_streams_pass_through_and_a_dead_backend_is_routed_around(cluster):
    router, backends, _ = cluster
    body = {
        "messages": [{"role": "user", "content": "t5 t6 t7"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
    }
    streamed = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.rstrip().endswith("data: [DONE]")
    backends[0].stop()
    for _ in range(4):
        plain = httpx.post(
            f"{router.url}/generate",
            json={"text": "t9 t8 t7", "sampling_params": {"max_new_tokens": 3}},
            timeout=60,
        )
        assert plain.status_code == 200 and plain.json()["meta_info"]["completion_tokens"] == 3
    assert httpx.get(f"{router.url}/health").json()["backends_up"] == [backends[1].url]
    backends[1].stop()
    gone = httpx.post(f"{router.url}/generate", json={"text": "t1"}, timeout=60)
    assert gone.status_code == 503 and gone.json()["error"]["code"] == "no_backend"


def test_a_backend_whose_events_stop_has_its_pages_forgotten(caplog):
    from radixserve.cache import RadixCache, TokenToKVPoolAllocator
    from radixserve.router.state import Router

    now = [0.0]
    router = Router(["http://a", "http://b"], "precise", events_timeout=10, clock=lambda: now[0])
    cache = RadixCache(TokenToKVPoolAllocator(100), enable_kv_events=True)
    prompt = list(range(1, 41))
    cache.insert(np.array(prompt, dtype=np.int32), cache.allocator.alloc(40))
    router.on_events(0, cache.take_events())
    held = lambda: router.policy.cached_tokens(RouteRequest(prompt))  # noqa: E731
    assert held() == [40, 0]
    other = [90, 91]  # routed for the expiry check without touching the prompt's pages
    now[0] = 9.0
    router.on_events(1, [])  # backend 1's heartbeat; backend 0 stays quiet
    router.order(other, None)
    assert held() == [40, 0]
    now[0] = 10.5
    router.order(other, None)
    assert held() == [0, 0]  # backend 0 has been silent for over 10 s: forgotten
    assert "no KV events" in caplog.text
    router.on_events(0, [])  # its heartbeats resume: new events count again
    cache.reset()
    cache.insert(np.array(prompt, dtype=np.int32), cache.allocator.alloc(40))
    router.on_events(0, [e for e in cache.take_events() if type(e).__name__ == "BlockStored"])
    assert held() == [40, 0]


def test_a_slow_backend_loses_its_affinity_to_load(cluster):
    """Requests sharing a prefix follow its KV while its backend keeps up; once that backend
    slows down, the requests queued there make the other one cheaper."""
    router, backends, _ = cluster

    def routed() -> list[int]:
        stats = httpx.get(f"{router.url}/router/stats").json()["backends"]
        return [b["routed"] for b in stats]

    def send(k: int) -> None:
        body = {"prompt": f"{SHARED} t{k % 80 + 3} t{k % 70 + 5}", "max_tokens": 4}
        reply = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200

    send(0)
    time.sleep(0.5)  # the home backend's events reach the router
    home = routed().index(1)
    before = routed()
    for k in range(1, 5):  # one at a time: the home backend keeps up
        send(k)
    after = routed()
    assert after[home] - before[home] == 4

    engine = backends[home].engine
    real_step = engine.step

    def slow_step():
        time.sleep(0.25)
        return real_step()

    engine.step = slow_step
    threads = []
    start = time.monotonic()
    for k in range(5, 15):  # a request every 0.1 s; the home backend now takes seconds each
        threads.append(threading.Thread(target=send, args=(k,)))
        threads[-1].start()
        time.sleep(0.1)
    for thread in threads:
        thread.join(60)
    assert time.monotonic() - start < 60
    final = routed()
    assert final[1 - home] - after[1 - home] >= 3  # load took over from affinity
    assert sum(final) == 15
    engine.step = real_step
    for b in backends:
        b.idle_check()


def test_a_replaced_backend_starts_with_nothing():
    """A restarted replica takes its predecessor's slot: no load, no pages, not down."""
    from radixserve.cache import RadixCache, TokenToKVPoolAllocator
    from radixserve.router.state import Router

    router = Router(["a", "b"], "precise")
    cache = RadixCache(TokenToKVPoolAllocator(100), enable_kv_events=True)
    prompt = list(range(1, 41))
    cache.insert(np.array(prompt, dtype=np.int32), cache.allocator.alloc(40))
    router.on_events(0, cache.take_events())
    router.start(0, 40)
    router.mark_down(0)
    assert router.order(prompt, None)[-1] == 0  # down: tried last
    router.replace(0, "a2")
    assert router.backends[0].url == "a2" and not router.backends[0].in_flight
    assert router.policy.cached_tokens(RouteRequest(prompt))[0] == 0
    assert router.order([7, 8], None) == [0, 1]
