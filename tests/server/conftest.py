"""A live radixserve server on loopback, over a tiny random model built by the tests."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from model_helpers import tiny_checkpoint

from radixserve.engine import Engine
from radixserve.server.app import create_app


class LiveServer:
    def __init__(self, engine: Engine, **options) -> None:
        import uvicorn

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.engine = engine
        self.app = create_app(engine, served_model_name="tiny", **options)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def idle_check(self) -> None:
        """Wait until no request runs, then check the invariants on the engine thread."""
        deadline = time.monotonic() + 15
        while self.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not self.engine.has_work()
        self.engine.check_invariants()
        cache, allocator = self.engine.cache, self.engine.allocator
        assert cache.protected_size() == 0
        assert allocator.available_size() + cache.total_size() == allocator.size


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("served"), "llama")


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    server = LiveServer(Engine(str(tiny_model_dir), dtype="float64"), max_body_bytes=64_000)
    yield server
    server.stop()
