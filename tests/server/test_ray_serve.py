"""radixserve on Ray Serve, for real: an in-process local Ray cluster on loopback, two engine
replicas of a tiny model behind the ingress, routed by `precise` inside Serve's request path.

One cluster serves the whole module (starting it takes about 20 s); it is shut down at the end.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install 'radixserve[ray]'")
pytest.importorskip("zmq", reason="precise routing follows KV events (events extra)")

import ray
from ray import serve

from radixserve.router.ray_serve import APP_NAME, build_app, wait_running

SHARED = " ".join(f"t{i % 90 + 3}" for i in range(120))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = {"model": str(tiny_model_dir), "dtype": "float32", "threads": 1}
        serve.run(
            build_app(options, 2, "precise", served_model_name="tiny", events_timeout=30),
            name=APP_NAME,
            route_prefix="/",
            blocking=False,
        )
        wait_running(180)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(url: str, prompt: str, max_tokens: int = 3, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_the_openai_api_on_ray_serve(cluster):
    url = cluster
    assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "t5 t6 t7"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
    }
    streamed = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.rstrip().endswith("data: [DONE]")
    native = httpx.post(
        f"{url}/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}},
        timeout=120,
    )
    assert native.status_code == 200 and native.json()["meta_info"]["completion_tokens"] == 4
    # Bad input is refused with the field named, whether the ingress or a replica finds it.
    negative = _complete(url, "t5", max_tokens=-3)
    assert negative.status_code == 400 and negative.json()["error"]["param"] == "max_tokens"
    too_long = _complete(url, "t5", max_tokens=10**6)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    bad = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": body["messages"], "response_format": schema},
        timeout=120,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    wrong_model = _complete(url, "t5", model="other")
    assert wrong_model.status_code == 404


def test_precise_keeps_a_shared_prefix_on_the_replica_holding_it(cluster):
    url = cluster
    first = _complete(url, SHARED + " t1")
    assert first.status_code == 200
    time.sleep(0.5)  # the replica's KV events reach the router
    for k in range(5):
        reply = _complete(url, f"{SHARED} t{k + 4} t{k + 5}")
        assert reply.status_code == 200
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 120


def _replica_actors() -> list:
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "EngineReplica" in a["name"]
    ]
    return [ray.get_actor(name, namespace="serve") for name in names]


def test_a_replica_killed_under_load(cluster):
    """Every stream in flight on the killed replica ends with an error naming it, the others
    finish; Serve restarts the replica and the application serves again."""
    url = cluster
    started = threading.Barrier(9, timeout=60)
    outcomes: list[tuple[str, str]] = []

    def stream(k: int) -> None:
        body = {"prompt": f"t{k + 3} t{k + 4}", "max_tokens": 480, "ignore_eos": True}
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
        ) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            text = [next(line for line in lines if line.startswith("data:"))]
            started.wait()
            text += [line for line in lines if line.startswith("data:")]
        errors = [line for line in text if '"error"' in line]
        outcomes.append(("error", errors[0]) if errors else ("ok", text[-2]))

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(8)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    started.wait()  # every stream has its first chunk: all 8 run on some replica
    actors = _replica_actors()
    loads = [ray.get(a.record_routing_stats.remote(), timeout=30) for a in actors]
    held = [stats["waiting"] + stats["running"] for stats in loads]
    ray.kill(actors[held.index(max(held))], no_restart=True)
    for thread in threads:
        thread.join(120)
    assert len(outcomes) == 8
    failed = [line for kind, line in outcomes if kind == "error"]
    assert all("the replica serving this request died" in line for line in failed)
    assert 1 <= len(failed) <= max(held)  # the victim's requests failed, and only they did
    assert all('"finish_reason": "length"' in line for kind, line in outcomes if kind == "ok")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        app = serve.status().applications[APP_NAME]
        states = app.deployments["EngineReplica"].replica_states
        if app.status == "RUNNING" and states.get("RUNNING", 0) == 2:
            break
        time.sleep(0.5)
    else:
        pytest.fail("Serve did not bring the killed replica back")
    for k in range(4):
        assert _complete(url, f"t{k + 7} t8").status_code == 200
    assert time.monotonic() - start < 240
