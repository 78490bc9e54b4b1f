"""The engine loop on a thread of its own, apart from the HTTP event loop.

HTTP handlers submit work through a thread-safe inbox and await the answers; the worker
thread alone touches the engine. Each request's chunks go to an asyncio queue on the event
loop that submitted it, so a step never waits on a slow client and a client never blocks a
step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from radixserve.engine import Engine, StreamChunk
from radixserve.errors import RadixServeError

log = logging.getLogger(__name__)


class QueueFullError(RadixServeError):
    """More requests are queued than --max-queued-requests allows."""


class BusyError(RadixServeError):
    """The operation needs an idle engine."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    last_token_time: float | None = None
    submitted: float = field(default_factory=time.monotonic)


class EngineWorker:
    """Runs `engine.step()` in a loop; everything else reaches the engine through `call`."""

    def __init__(
        self,
        engine: Engine,
        max_queued_requests: int = 1024,
        on_chunk: Callable[[StreamChunk, _Stream, float], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.on_chunk = on_chunk
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._pending = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what runs, stop the loop and join the thread."""
        if not self._thread.is_alive():
            return
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    # -- called from the event loop -------------------------------------------------------

    async def call(self, fn: Callable[[Engine], object]):
        """Run `fn(engine)` on the engine thread and return its result (or raise its error)."""
        future: Future = Future()
        self._inbox.put((fn, future))
        return await asyncio.wrap_future(future)

    async def submit(self, prompt, params: dict, rid: str) -> asyncio.Queue:
        """Queue one request; its chunks arrive on the returned queue, the last one finished."""
        with self._lock:
            waiting = len(self.engine.scheduler.waiting) + self._pending
            if waiting >= self.max_queued_requests:
                raise QueueFullError(
                    f"{waiting} requests are queued (--max-queued-requests "
                    f"{self.max_queued_requests}); try again later"
                )
            self._pending += 1
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())

        def add(engine: Engine) -> None:
            with self._lock:
                self._pending -= 1
            engine.add_request(prompt, params, rid=rid)
            self._streams[rid] = stream

        await self.call(add)
        return stream.queue

    def abort(self, rid: str) -> None:
        """Abort `rid` if it still runs (thread-safe, does not wait)."""

        def drop(engine: Engine) -> None:
            self._streams.pop(rid, None)
            engine.abort(rid)

        self._inbox.put((drop, None))

    # -- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain(block=not engine.has_work())
            if self._stop.is_set():
                break
            if not engine.has_work():
                continue
            try:
                chunks = engine.step()
            except Exception:  # pragma: no cover - a bug; fail the requests, keep serving
                log.exception("engine step failed; aborting the running requests")
                for rid in list(self._streams):
                    engine.abort(rid)
                chunks = engine.step()
            now = time.monotonic()
            for chunk in chunks:
                stream = self._streams.get(chunk.rid)
                if stream is None:
                    continue
                if self.on_chunk is not None:
                    self.on_chunk(chunk, stream, now)
                if chunk.token_ids:
                    stream.last_token_time = now
                if chunk.finished:
                    del self._streams[chunk.rid]
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, chunk)
        for rid in list(self._streams):
            engine.abort(rid)
        while engine.has_work():
            engine.step()

    def _drain(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            fn, future = item
            try:
                result = fn(self.engine)
            except Exception as exc:
                if future is not None:
                    future.set_exception(exc)
            else:
                if future is not None:
                    future.set_result(result)
