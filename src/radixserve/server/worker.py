"""The engine loop on a thread of its own, supervised, apart from the HTTP event loop.

HTTP handlers submit work through a thread-safe inbox and await the answers; the worker
thread alone touches the engine. Each request's chunks go to an asyncio queue on the event
loop that submitted it, so a step never waits on a slow client and a client never blocks a
step. The server reads engine state only through the `EngineSnapshot` the thread publishes.

What the worker guarantees:
- every submitted request gets exactly one final item on its queue: a finished chunk, or an
  `EngineDeadError` if the engine thread died;
- a failed model step ends only its batch's requests (the engine sees to that); a failure
  elsewhere in a step ends every request, and if the engine's state is then inconsistent the
  thread stops, `failure` is set and `on_fatal` is called so the process can exit;
- with `request_timeout`, a request still running that long after submission is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from radixserve.engine import Engine, StreamChunk
from radixserve.errors import RadixServeError
from radixserve.sched.request import SamplingParams
from radixserve.sched.scheduler import SchedulerStats

log = logging.getLogger(__name__)


class QueueFullError(RadixServeError):
    """More requests are queued than --max-queued-requests allows."""


class BusyError(RadixServeError):
    """The operation needs an idle engine."""


class ShuttingDownError(RadixServeError):
    """The server is draining for shutdown and admits no new requests."""


class EngineDeadError(RadixServeError):
    """The engine thread has stopped after a failure it could not recover from."""


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state as of the end of its latest step (or inbox drain)."""

    time: float
    steps: int
    failed_steps: int
    has_work: bool
    waiting: int
    running: int
    cache_evictable: int
    cache_protected: int
    cache_total: int
    kv_available: int
    kv_pool: int
    stats: SchedulerStats
    # The eviction policy's own report, where it gives one (`adaptive`'s `AdaptiveSummary`).
    eviction: object | None = None

    @classmethod
    def of(cls, engine: Engine, now: float, steps: int) -> EngineSnapshot:
        sched, cache = engine.scheduler, engine.cache
        return cls(
            time=now,
            steps=steps,
            failed_steps=engine.failed_steps,
            has_work=engine.has_work(),
            waiting=len(sched.waiting),
            running=len(sched.running) + (sched.prefilling is not None),
            cache_evictable=cache.evictable_size(),
            cache_protected=cache.protected_size(),
            cache_total=cache.total_size(),
            kv_available=engine.allocator.available_size(),
            kv_pool=engine.allocator.size,
            stats=dataclasses.replace(sched.stats),
            eviction=summary() if (summary := getattr(cache.policy, "summary", None)) else None,
        )


@dataclass(frozen=True)
class Part:
    """One engine request of an HTTP request, as `Engine.prepare_request` returned it."""

    input_ids: list[int]
    params: SamplingParams
    rid: str


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    last_token_time: float | None = None
    submitted: float = field(default_factory=time.monotonic)


class EngineWorker:
    """Runs `engine.step()` in a loop; everything else reaches the engine through the inbox."""

    def __init__(
        self,
        engine: Engine,
        max_queued_requests: int = 1024,
        request_timeout: float | None = None,
        watchdog: float | None = 60.0,
        on_chunk: Callable[[StreamChunk, _Stream, float], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        kv_events=None,
    ) -> None:
        self.engine = engine
        self.kv_events = kv_events  # a KVEventPublisher fed after every step, or None
        self.max_queued_requests = max_queued_requests
        self.request_timeout = request_timeout
        self.watchdog = watchdog
        self.on_chunk = on_chunk
        self.on_fatal = on_fatal
        self.clock = clock
        self.accepting = True
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._pending = 0
        self._steps = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        now = clock()
        self._beat = now
        self._step_started: float | None = None
        self._last_step_seconds = 0.0
        self._snapshot = EngineSnapshot.of(engine, now, 0)
        self._thread = threading.Thread(target=self._run, name="radixserve-engine", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what runs (their clients get a shutdown error), stop the loop, join."""
        self.accepting = False
        if not self._thread.is_alive():
            return
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    async def drain(self, timeout: float) -> bool:
        """Stop admitting, let running requests finish for up to `timeout` seconds, then
        abort the rest (cause `shutdown`). True if everything finished on its own."""
        self.accepting = False
        deadline = self.clock() + timeout
        while self.alive and self._busy() and self.clock() < deadline:
            await asyncio.sleep(0.02)
        finished = not self._busy()
        if not finished and self.alive:
            log.warning("shutdown timeout: aborting %d request(s)", len(self._streams))
            self.abort_all("the server is shutting down", cause="shutdown")
            end = self.clock() + 5.0
            while self.alive and self._busy() and self.clock() < end:
                await asyncio.sleep(0.02)
        return finished

    def _busy(self) -> bool:
        return bool(self._streams) or self._pending > 0 or self._snapshot.has_work

    @property
    def alive(self) -> bool:
        return self._failure is None and self._thread.is_alive()

    @property
    def failure(self) -> BaseException | None:
        """The exception that stopped the engine thread, if one did."""
        return self._failure

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def health(self) -> tuple[bool, dict]:
        """(healthy, details): dead, draining, or stuck for `watchdog` seconds is unhealthy."""
        now = self.clock()
        snap = self._snapshot
        started = self._step_started
        stalled = now - (started if started is not None else self._beat)
        details = {
            "steps": snap.steps,
            "failed_steps": snap.failed_steps,
            "last_step_seconds": round(self._last_step_seconds, 6),
            "seconds_since_progress": round(stalled, 3),
            "running": snap.running,
            "waiting": snap.waiting,
        }
        if not self.alive:
            failure = self._failure
            reason = type(failure).__name__ if failure is not None else "thread exited"
            return False, {"status": "dead", "error": reason, **details}
        if not self.accepting:
            return False, {"status": "draining", **details}
        if self.watchdog is not None and stalled > self.watchdog:
            return False, {"status": "stuck", **details}
        return True, {"status": "ok", **details}

    # -- called from the event loop -------------------------------------------------------

    async def call(self, fn: Callable[[Engine], object]):
        """Run `fn(engine)` on the engine thread and return its result (or raise its error).

        If the awaiting task is cancelled before `fn` starts, `fn` never runs.
        """
        future: Future = Future()
        with self._lock:
            if self._failure is not None:
                raise EngineDeadError(self._dead_message())
            self._inbox.put((fn, future))
        return await asyncio.wrap_future(future)

    async def submit(self, parts: Sequence[Part]) -> list[asyncio.Queue]:
        """Queue every part or none; each part's chunks arrive on its queue, the last one
        finished (or an `EngineDeadError`)."""
        if not self.accepting:
            raise ShuttingDownError("the server is shutting down; try another replica")
        with self._lock:
            queued = self._snapshot.waiting + self._pending
            if queued + len(parts) > self.max_queued_requests:
                raise QueueFullError(
                    f"{queued} requests are queued and this one adds {len(parts)} "
                    f"(--max-queued-requests {self.max_queued_requests}); try again later"
                )
            self._pending += len(parts)
        loop = asyncio.get_running_loop()
        streams = [_Stream(loop, asyncio.Queue(), submitted=self.clock()) for _ in parts]

        def add(engine: Engine) -> None:
            for part, stream in zip(parts, streams, strict=True):
                engine.add_prepared(part.input_ids, part.params, rid=part.rid)
                self._streams[part.rid] = stream
                if self.request_timeout is not None:
                    deadline = stream.submitted + self.request_timeout
                    heapq.heappush(self._deadlines, (deadline, part.rid))

        try:
            await self.call(add)
        except BaseException:
            # Refused, or the caller was cancelled while `add` may still run: whatever of the
            # group got in is aborted (the inbox is FIFO, so this runs after `add`).
            self.abort([p.rid for p in parts], "the client went away", "client")
            raise
        finally:
            with self._lock:
                self._pending -= len(parts)
        return [s.queue for s in streams]

    def abort(self, rids: Sequence[str], message: str = "aborted by the client", cause="client"):
        """Abort `rids` if they still run (thread-safe, does not wait); their final chunks
        come out of the next engine step."""

        def drop(engine: Engine) -> None:
            for rid in rids:
                engine.abort(rid, message, cause)

        self._inbox.put((drop, None))

    def abort_all(self, message: str, cause: str) -> None:
        """Abort every request the engine holds (thread-safe, does not wait)."""

        def drop(engine: Engine) -> None:
            for rid in engine.request_ids():
                engine.abort(rid, message, cause)

        self._inbox.put((drop, None))

    # -- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
            self._finish_all()
        except BaseException as exc:
            self._die(exc)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._beat = self.clock()
            drained = self._drain(block=not engine.has_work())
            self._expire()
            if self._stop.is_set():
                break
            if engine.has_work():
                self._step()
            elif drained:
                self._publish()

    def _step(self) -> None:
        engine = self.engine
        self._step_started = started = self.clock()
        try:
            chunks = engine.step()
        except Exception as exc:
            chunks = engine.recover(exc)  # raises EngineError when the state is broken
        now = self.clock()
        self._step_started = None
        self._last_step_seconds = now - started
        self._steps += 1
        self._deliver_all(chunks, now)
        self._publish()

    def _publish(self) -> None:
        self._snapshot = EngineSnapshot.of(self.engine, self.clock(), self._steps)
        if self.kv_events is not None:
            self.kv_events.publish(self.engine.cache.take_events())

    def _deliver_all(self, chunks: list[StreamChunk], now: float) -> None:
        for chunk in chunks:
            stream = self._streams.get(chunk.rid)
            if stream is None:
                continue
            if self.on_chunk is not None:
                try:
                    self.on_chunk(chunk, stream, now)
                except Exception:  # a metrics bug must not take the engine down
                    log.exception("on_chunk failed")
            if chunk.token_ids:
                stream.last_token_time = now
            if chunk.finished:
                del self._streams[chunk.rid]
            _deliver(stream, chunk)

    def _expire(self) -> None:
        if not self._deadlines:
            return
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            if rid in self._streams:
                self.engine.abort(
                    rid,
                    f"the request ran past --request-timeout ({self.request_timeout:g} s)",
                    cause="timeout",
                )

    def _drain(self, block: bool) -> bool:
        """Run what the inbox holds; True if anything ran."""
        ran = False
        while True:
            try:
                item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                return ran
            block = False
            if item is None:
                return ran
            fn, future = item
            if future is not None and not future.set_running_or_notify_cancel():
                continue  # the caller gave up before this ran
            ran = True
            try:
                result = fn(self.engine)
            except Exception as exc:
                if future is not None:
                    future.set_exception(exc)
            else:
                if future is not None:
                    future.set_result(result)

    def _finish_all(self) -> None:
        """On stop: abort whatever is left and hand every client its final chunk."""
        engine = self.engine
        self._drain(block=False)
        for rid in engine.request_ids():
            engine.abort(rid, "the server is shutting down", cause="shutdown")
        while engine.has_work():
            self._step()

    def _die(self, exc: BaseException) -> None:
        log.critical("the engine thread failed and stopped: %r", exc, exc_info=exc)
        with self._lock:
            self._failure = exc
            self.accepting = False
            streams = list(self._streams.values())
            self._streams.clear()
        error = EngineDeadError(self._dead_message())
        for stream in streams:
            _deliver(stream, error)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[1] is not None:
                future = item[1]
                if future.set_running_or_notify_cancel():
                    future.set_exception(EngineDeadError(self._dead_message()))
        with contextlib.suppress(Exception):  # the engine may be too broken to describe itself
            self._publish()
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _dead_message(self) -> str:
        exc = self._failure
        what = f"{type(exc).__name__}: {exc}" if exc is not None else "unknown failure"
        return f"the engine has stopped after a failure ({what}); the server is restarting"


def _deliver(stream: _Stream, item) -> None:
    with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
