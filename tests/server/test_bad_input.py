"""Bad input gets a 4xx with an OpenAI-style error that names the field; the server stays up."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from conftest import LiveServer

from radixserve.engine import Engine

CASES = [
    ("malformed json", "/v1/completions", b"{not json", 400, None),
    ("wrong type", "/v1/completions", {"prompt": 5, "max_tokens": 4}, 400, "prompt"),
    ("unknown field", "/v1/completions", {"prompt": "t1", "frobnicate": 1}, 400, "frobnicate"),
    (
        "negative max_tokens",
        "/v1/completions",
        {"prompt": "t1", "max_tokens": -1},
        400,
        "max_tokens",
    ),
    (
        "too many tokens",
        "/v1/completions",
        {"prompt": "t1", "max_tokens": 10**6},
        400,
        "max_tokens",
    ),
    (
        "prompt longer than context",
        "/v1/completions",
        {"prompt": " ".join(["t3"] * 600), "max_tokens": 1},
        400,
        "prompt",
    ),
    (
        "temperature out of range",
        "/v1/completions",
        {"prompt": "t1", "temperature": 9},
        400,
        "temperature",
    ),
    ("echo refused", "/v1/completions", {"prompt": "t1", "echo": True}, 400, "echo"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "bad role",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    (
        "unknown model",
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": [{"role": "user", "content": "t1"}]},
        404,
        "model",
    ),
    ("token id out of vocab", "/generate", {"input_ids": [1, 100000]}, 400, "prompt"),
    ("text and ids", "/generate", {"text": "t1", "input_ids": [1]}, 400, "text"),
    (
        "nested 5,000 deep",
        "/v1/completions",
        b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        400,
        None,
    ),
    ("lone surrogate", "/v1/completions", b'{"prompt": "t1 \\ud800"}', 400, "prompt"),
    (
        "lone surrogate in chat",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        "messages",
    ),
    (
        "unknown sampling param",
        "/generate",
        {"text": "t1", "sampling_params": {"bogus": 1}},
        400,
        None,
    ),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_matrix(live, name, path, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(
        f"{live.url}{path}", headers={"content-type": "application/json"}, **kwargs
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    assert httpx.get(f"{live.url}/health").status_code == 200
    live.idle_check()


def test_unknown_routes_and_methods_get_the_openai_error_shape(live):
    for response in (httpx.get(f"{live.url}/nope"), httpx.get(f"{live.url}/v1/completions")):
        assert response.status_code in (404, 405)
        assert response.json()["error"]["message"]


def test_body_over_the_limit_gets_413(live):
    body = {"prompt": "t1 " * 40_000, "max_tokens": 1}
    response = httpx.post(f"{live.url}/v1/completions", json=body)
    assert response.status_code == 413
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_queue_full_gets_429(tiny_model_dir):
    server = LiveServer(Engine(str(tiny_model_dir), max_running_requests=1), max_queued_requests=1)
    try:
        import concurrent.futures

        body = {"prompt": "t5 t6", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(
                pool.map(
                    lambda _: (
                        httpx.post(
                            f"{server.url}/v1/completions", json=body, timeout=60
                        ).status_code
                    ),
                    range(8),
                )
            )
        assert 429 in codes and 200 in codes
        server.idle_check()
    finally:
        server.stop()


def test_api_key_is_required(tiny_model_dir):
    server = LiveServer(Engine(str(tiny_model_dir)), api_key="sekrit")
    try:
        url = f"{server.url}/v1/models"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()


def test_every_response_carries_one_request_id(tiny_model_dir):
    """Plain, streamed, refused and invalid requests alike: exactly one x-request-id, a fresh
    one per request."""
    server = LiveServer(Engine(str(tiny_model_dir)), api_key="sekrit", max_body_bytes=64_000)
    key = {"Authorization": "Bearer sekrit"}
    url = server.url
    body = {"prompt": "t5 t6", "max_tokens": 3, "temperature": 0}
    try:
        responses = [
            httpx.post(f"{url}/v1/completions", json=body, headers=key),
            httpx.post(f"{url}/v1/completions", json=body),  # 401
            httpx.post(f"{url}/v1/completions", json={"prompt": "t1 " * 40_000}, headers=key),
            httpx.post(f"{url}/v1/completions", json={"max_tokens": -1}, headers=key),  # 400
            httpx.get(f"{url}/nope", headers=key),  # 404
            httpx.get(f"{url}/health"),
        ]
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=key
        ) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and len(events) >= 2
        responses.append(streamed)
        assert [r.status_code for r in responses] == [200, 401, 413, 400, 404, 200, 200]
        ids = [r.headers.get_list("x-request-id") for r in responses]
        assert all(len(found) == 1 for found in ids), ids
        assert len({found[0] for found in ids}) == len(ids)
        server.idle_check()
    finally:
        server.stop()


def test_a_client_that_disconnects_mid_stream_leaks_nothing(live):
    body = (
        b'{"prompt": "t5 t6 t7", "max_tokens": 400, "ignore_eos": true, "temperature": 0,'
        b' "stream": true}'
    )
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while b"data:" not in received:  # wait until the stream has started
            received += sock.recv(4096)
        assert live.engine.has_work()
    deadline = time.monotonic() + 15
    while live.engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live.engine.has_work(), "the request was not aborted"
    live.idle_check()
    metrics = httpx.get(f"{live.url}/metrics").text
    assert "radixserve_cache_protected_tokens 0.0" in metrics
