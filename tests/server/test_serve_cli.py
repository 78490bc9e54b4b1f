"""`radixserve serve`: one ready line, answers on loopback, exits 0 on SIGTERM and Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_prints_ready_and_exits_0_on_a_signal(tiny_model_dir, sig):
    proc, url = _start_server(tiny_model_dir)
    with _killed_at_exit(proc):
        out = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "t5 t6", "max_tokens": 3},
            timeout=30,
        )
        assert out.status_code == 200
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0


@contextlib.contextmanager
def _killed_at_exit(proc: subprocess.Popen):
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start_server(model_dir, *flags, launcher=("-m", "radixserve.cli")):
    """`radixserve serve` on a free loopback port, once it printed its ready line."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            *launcher,
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if not line.startswith(f"radixserve ready on http://127.0.0.1:{port}"):
        proc.kill()
        raise AssertionError(line + proc.stderr.read())
    return proc, f"http://127.0.0.1:{port}"


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_sigterm_under_load_drains_then_exits_and_every_client_gets_an_answer(tiny_model_dir):
    import concurrent.futures
    import json

    proc, url = _start_server(tiny_model_dir, "--shutdown-timeout", "1")
    with _killed_at_exit(proc):

        def client(k: int) -> tuple[int, str]:
            body = {"prompt": f"t{5 + k} t6 t7", "max_tokens": 480, "ignore_eos": True}
            if k % 2:
                out = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                return out.status_code, out.text
            with httpx.stream(
                "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
            ) as out:
                return out.status_code, out.read().decode()

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(client, k) for k in range(12)]
            deadline = time.monotonic() + 30
            while _metric(url, "radixserve_running_requests") < 12:
                assert time.monotonic() < deadline, "the load never built up"
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            refused = httpx.post(f"{url}/v1/completions", json={"prompt": "t5"}, timeout=10)
            assert refused.status_code == 503
            assert proc.wait(timeout=15) == 0
            took = time.monotonic() - sent
            answers = [f.result(timeout=30) for f in futures]
        assert took < 1 + 6, f"exit took {took:.1f} s with --shutdown-timeout 1"
        for status, text in answers:
            if text.startswith("data:"):  # a stream: completed, or an error event, then [DONE]
                events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                last = json.loads(events[-2])
                assert "error" not in last or last["error"]["code"] == "shutting_down", last
            else:
                assert status in (200, 503), text
                if status == 503:
                    assert json.loads(text)["error"]["code"] == "shutting_down"
        assert any("shutting_down" in text for _, text in answers), "nothing was cut short"


_BROKEN_ENGINE = """
import sys
from radixserve import cli, engine
from radixserve.errors import EngineError

def step(self):
    raise RuntimeError("injected scheduler bug")

def recover(self, exc):
    raise EngineError("injected: state is broken")

engine.Engine.step, engine.Engine.recover = step, recover
sys.exit(cli.main(sys.argv[1:]))
"""


def test_an_engine_that_dies_makes_the_server_exit_non_zero(tiny_model_dir):
    proc, url = _start_server(tiny_model_dir, launcher=("-c", _BROKEN_ENGINE))
    with _killed_at_exit(proc):
        out = httpx.post(f"{url}/v1/completions", json={"prompt": "t5"}, timeout=30)
        assert out.status_code == 503 and out.json()["error"]["code"] == "engine_dead"
        assert proc.wait(timeout=30) == 1
        assert "the engine failed" in proc.stderr.read()


def test_a_prefix_survives_a_server_restart_through_file_storage(tmp_path):
    """The issue's restart test: a 2,000-token prefix, the server stopped and started again
    on the same --hicache-storage, a new question on that prefix is served from storage."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from model_helpers import tiny_checkpoint

    model = tiny_checkpoint(tmp_path / "model", "llama", max_position_embeddings=4096)
    flags = ("--hicache-storage", f"file:{tmp_path / 'kv'}", "--kv-cache-tokens", "8192")
    prefix = [3 + (11 * i) % 90 for i in range(2000)]

    def ask(url: str, question: list[int]) -> dict:
        body = {"input_ids": prefix + question, "sampling_params": {"max_new_tokens": 2}}
        reply = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["meta_info"]

    proc, url = _start_server(model, *flags)
    with contextlib.closing(proc.stdout), _killed_at_exit(proc):
        assert ask(url, [5, 6, 7])["cached_tokens"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0  # pending writes finish before the process exits
    proc, url = _start_server(model, *flags)
    with contextlib.closing(proc.stdout), _killed_at_exit(proc):
        meta = ask(url, [8, 9])
        assert meta["cached_tokens"] >= 1984 and meta["storage_cached_tokens"] >= 1984
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
