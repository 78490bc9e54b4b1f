"""Serving under faults: disconnects, partial failures, failing steps, a dead or stuck engine,
timeouts. Each test drives a live server on loopback and checks that every request ends, once,
with the right status, and that the KV pool comes back whole."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from conftest import LiveServer

from radixserve.engine import Engine
from radixserve.errors import EngineError

LONG = {"prompt": "t5 t6 t7", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def slow_down(engine: Engine, seconds: float, fail_if=None, hold: threading.Event | None = None):
    """Make every forward take `seconds`; raise where `fail_if(batch)`; block while `hold` is
    clear. Returns the list of batches that were made to fail."""
    real = engine._forward
    failed = []

    def forward(batch):
        time.sleep(seconds)
        if hold is not None:
            hold.wait(30)
        if fail_if is not None and fail_if(batch):
            failed.append(batch)
            raise RuntimeError("injected fault")
        return real(batch)

    engine._forward = forward
    return failed


def rids_of(batch) -> list[str]:
    return [e.req.rid for e in batch.entries]


def snapshot(server: LiveServer):
    return server.app.state.worker.snapshot


def wait_for(condition, timeout: float, step: float = 0.01) -> float:
    """Seconds until `condition()` held; fails the test at `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - start


def raw_post(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def generated_tokens(server: LiveServer) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    for line in text.splitlines():
        if line.startswith("radixserve_generation_tokens_total "):
            return float(line.split()[1])
    return 0.0


@pytest.fixture
def server(tiny_model_dir, request):
    options = getattr(request, "param", {})
    engine_options = options.pop("engine", {})
    live = LiveServer(Engine(str(tiny_model_dir), dtype="float64", **engine_options), **options)
    yield live
    live.stop()


def test_a_non_streaming_client_that_disconnects_is_aborted_within_a_second(server):
    slow_down(server.engine, 0.01)
    sock = raw_post(server.port, "/v1/completions", LONG)
    wait_for(lambda: generated_tokens(server) > 5, 10)
    sock.close()
    took = wait_for(lambda: not snapshot(server).has_work, 5)
    assert took < 1.0, f"still running {took:.2f} s after the disconnect"
    before = generated_tokens(server)
    time.sleep(0.3)
    assert generated_tokens(server) == before
    server.idle_check()


def test_a_streaming_client_that_disconnects_is_aborted_within_a_second(server):
    slow_down(server.engine, 0.01)
    sock = raw_post(server.port, "/v1/completions", {**LONG, "stream": True})
    received = b""
    while received.count(b"data:") < 3:
        received += sock.recv(4096)
    sock.close()
    took = wait_for(lambda: not snapshot(server).has_work, 5)
    assert took < 1.0, f"still running {took:.2f} s after the disconnect"
    server.idle_check()


@pytest.mark.parametrize("server", [{"max_queued_requests": 2}], indirect=True)
def test_a_group_that_does_not_fit_in_the_queue_starts_nothing(server):
    arrivals = server.engine.scheduler._arrivals
    out = httpx.post(f"{server.url}/v1/completions", json={**LONG, "n": 4}, timeout=30)
    assert out.status_code == 429
    assert out.json()["error"]["code"] == "queue_full"
    assert server.engine.scheduler._arrivals == arrivals
    assert not server.engine.has_work()
    out = httpx.post(f"{server.url}/v1/completions", json={"prompt": ["t5", "t6"]}, timeout=30)
    assert out.status_code == 200  # a group that fits is served whole


@pytest.mark.parametrize("server", [{"engine": {"max_running_requests": 2}}], indirect=True)
@pytest.mark.parametrize("stream", [False, True])
def test_one_failing_choice_of_four_leaves_nothing_running(server, stream):
    # Parts 0 and 1 run first and fail together; 2 and 3 are still queued then.
    slow_down(server.engine, 0.005, fail_if=lambda b: any(r.endswith("-0") for r in rids_of(b)))
    body = {**LONG, "n": 4, "stream": stream}
    out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    if stream:
        events = [line[6:] for line in out.text.splitlines() if line.startswith("data: ")]
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]"
    else:
        assert out.status_code == 500
        error = out.json()["error"]
    assert error["type"] == "server_error" and "RuntimeError: injected fault" in error["message"]
    assert "request id req-" in error["message"]
    took = wait_for(lambda: not snapshot(server).has_work, 5)
    assert took < 0.5, "the other choices kept running"
    server.idle_check()


def test_a_failed_step_fails_only_its_batch_with_a_500(server):
    server.engine._forward = _fail_on_prompt(server.engine, 9)
    results = {}

    def survivor():
        body = {**LONG, "max_tokens": 60}
        results["ok"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)

    thread = threading.Thread(target=survivor)
    thread.start()
    wait_for(lambda: generated_tokens(server) > 3, 10)
    doomed = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "t9 t9 t9", "max_tokens": 5}, timeout=30
    )
    thread.join(30)
    assert doomed.status_code == 500, doomed.text
    error = doomed.json()["error"]
    assert "RuntimeError: injected fault" in error["message"]
    assert doomed.headers["x-request-id"] in error["message"]
    ok = results["ok"]
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 60
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "radixserve_engine_failed_steps_total 1.0" in httpx.get(f"{server.url}/metrics").text
    server.idle_check()


def _fail_on_prompt(engine: Engine, token: int):
    """A forward that fails on any batch holding a request whose prompt starts with `token`."""
    real = engine._forward

    def forward(batch):
        time.sleep(0.002)
        if any(int(e.req.input_ids[0]) == token for e in batch.entries):
            raise RuntimeError("injected fault")
        return real(batch)

    return forward


@pytest.mark.parametrize("kill", ["broken state", "thread killed"])
def test_a_dead_engine_fails_waiting_handlers_and_turns_health_503(tiny_model_dir, kill):
    fatal = []
    live = LiveServer(Engine(str(tiny_model_dir)), on_engine_failure=fatal.append)
    try:
        engine = live.engine
        slow_down(engine, 0.005)
        real_step = engine.step
        steps = []

        def step():
            steps.append(1)
            if len(steps) == 20:
                if kill == "thread killed":
                    raise SystemExit("killed")
                raise RuntimeError("scheduler bug")
            return real_step()

        engine.step = step
        engine.recover = lambda exc: (_ for _ in ()).throw(EngineError("state is broken"))
        start = time.monotonic()
        out = httpx.post(f"{live.url}/v1/completions", json=LONG, timeout=30)
        assert time.monotonic() - start < 10
        assert out.status_code == 503 and out.json()["error"]["code"] == "engine_dead"
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        again = httpx.post(f"{live.url}/v1/completions", json=LONG, timeout=30)
        assert again.status_code == 503
        assert "radixserve_engine_failures_total 1.0" in httpx.get(f"{live.url}/metrics").text
        assert len(fatal) == 1
    finally:
        live.stop()


@pytest.mark.parametrize("server", [{"watchdog": 0.3}], indirect=True)
def test_a_stuck_engine_is_unhealthy_until_it_moves_again(server):
    hold = threading.Event()
    slow_down(server.engine, 0.0, hold=hold)
    assert httpx.get(f"{server.url}/health").status_code == 200
    thread = threading.Thread(
        target=httpx.post,
        args=(f"{server.url}/v1/completions",),
        kwargs={"json": {"prompt": "t5", "max_tokens": 2}, "timeout": 30},
    )
    thread.start()
    wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, 5)
    assert httpx.get(f"{server.url}/health").json()["status"] == "stuck"
    hold.set()
    thread.join(30)
    wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200, 5)
    server.idle_check()


@pytest.mark.parametrize("server", [{"request_timeout": 0.5}], indirect=True)
def test_a_request_past_the_timeout_gets_504_and_frees_its_slots(server):
    slow_down(server.engine, 0.01)
    start = time.monotonic()
    out = httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=30)
    took = time.monotonic() - start
    assert out.status_code == 504, out.text
    assert out.json()["error"]["code"] == "request_timeout"
    assert "--request-timeout" in out.json()["error"]["message"]
    assert 0.5 <= took < 2.0
    short = httpx.post(f"{server.url}/v1/completions", json={"prompt": "t5", "max_tokens": 3})
    assert short.status_code == 200
    server.idle_check()


def test_draining_refuses_new_requests_and_aborts_the_rest(server):
    import asyncio

    slow_down(server.engine, 0.01)
    results = {}

    def long_request():
        results["long"] = httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=30)

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_for(lambda: generated_tokens(server) > 3, 10)
    worker = server.app.state.worker
    finished = asyncio.run(worker.drain(0.3))
    thread.join(30)
    assert not finished
    assert results["long"].status_code == 503
    assert results["long"].json()["error"]["code"] == "shutting_down"
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "t5"})
    assert refused.status_code == 503
    assert httpx.get(f"{server.url}/health").json()["status"] == "draining"
    server.idle_check()
