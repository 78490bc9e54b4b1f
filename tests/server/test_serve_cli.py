"""`radixserve serve`: one ready line, answers on loopback, exits 0 on SIGTERM and Ctrl-C."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_prints_ready_and_exits_0_on_a_signal(tiny_model_dir, sig):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"radixserve ready on http://127.0.0.1:{port}")
        out = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "t5 t6", "max_tokens": 3},
            timeout=30,
        )
        assert out.status_code == 200
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.1)
