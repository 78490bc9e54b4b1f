"""Between an HTTP handler and the engine thread: preparing, submitting and following requests.

Tokenization, the chat template and request validation run in a small thread pool, off both
the event loop and the engine thread. One HTTP request (several prompts, `n` choices) becomes a
`Group` of engine requests that is submitted whole or not at all, and that ends whole: when
the client disconnects, when one part fails, or when the handler stops reading, every part
still running is aborted.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request

from radixserve.engine import Engine, GenerateResult, StreamChunk
from radixserve.errors import InvalidArgumentError
from radixserve.server.errors import APIError, check_result, invalid_argument
from radixserve.server.worker import (
    EngineDeadError,
    EngineWorker,
    Part,
    QueueFullError,
    ShuttingDownError,
)


class Dispatcher:
    """Prepares requests off the event loop and starts them on the engine as groups."""

    def __init__(self, engine: Engine, worker: EngineWorker, threads: int = 2) -> None:
        self.engine = engine
        self.worker = worker
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="radixserve-prepare")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def off_thread(self, fn: Callable, *args):
        """`fn(*args)` in the preparation pool; an `InvalidArgumentError` becomes a 400."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except InvalidArgumentError as exc:
            raise invalid_argument(exc) from None

    async def chat_prompt(self, messages: list[dict], **template_args) -> list[int]:
        """The token ids of `messages` under the model's chat template."""
        tokenizer = self.engine.tokenizer

        def render() -> list[int]:
            try:
                text = tokenizer.apply_chat_template(messages, **template_args)
                return tokenizer.encode(text, add_special_tokens=False)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(str(exc), field="messages") from None

        return await self.off_thread(render)

    async def start(
        self,
        request: Request,
        jobs: Sequence[tuple[str | list[int], dict]],
        grammar_param: str | None = None,
    ) -> Group:
        """Validate and encode (prompt, sampling params) jobs off the event loop, compile any
        grammar they ask for (a bad one is a 400 naming `grammar_param`, else its own field),
        then submit them all or none (429 when the queue is full, 503 while shutting down)."""
        request_id = request.state.request_id

        def build() -> tuple[list[Part], list]:
            parts, grammars = [], []
            for k, (prompt, params) in enumerate(jobs):
                ids, checked = self.engine.prepare_request(prompt, params)
                parts.append(Part(ids, checked, f"{request_id}-{k}"))
                grammars.append(self.engine.compile_grammar(checked))
            return parts, grammars

        parts, grammars = await self.off_thread(build)
        for compiled in {id(g): g for g in grammars if g is not None}.values():
            try:
                await asyncio.wrap_future(compiled)
            except InvalidArgumentError as exc:
                error = invalid_argument(exc)
                error.param = grammar_param or error.param
                raise error from None
        try:
            queues = await self.worker.submit(parts)
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full") from None
        except ShuttingDownError as exc:
            raise APIError(503, str(exc), code="shutting_down") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except InvalidArgumentError as exc:
            raise invalid_argument(exc) from None
        return Group(request, self.worker, [p.rid for p in parts], queues)


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


class Group:
    """The engine requests of one HTTP request, followed to their ends."""

    def __init__(
        self, request: Request, worker: EngineWorker, rids: list[str], queues: list[asyncio.Queue]
    ) -> None:
        self.request, self.worker, self.rids, self.queues = request, worker, rids, queues
        self.finished: set[str] = set()

    def unfinished(self) -> list[str]:
        return [rid for rid in self.rids if rid not in self.finished]

    async def results(self) -> list[GenerateResult]:
        """Every part's result, in order; the first failure raises its APIError."""
        async with self._watching():
            return [check_result(await self._final(q)) for q in self.queues]

    async def chunks(self) -> AsyncIterator[tuple[int, StreamChunk]]:
        """(part index, chunk) as the engine produces them, until every part has finished."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, q: asyncio.Queue) -> None:
            while True:
                item = await q.get()
                await merged.put((k, item))
                if not isinstance(item, StreamChunk) or item.finished:
                    return

        async with self._watching():
            tasks = [asyncio.create_task(pump(k, q)) for k, q in enumerate(self.queues)]
            try:
                done = 0
                while done < len(self.queues):
                    k, item = await merged.get()
                    chunk = _unwrap(item)
                    if chunk.finished:
                        done += 1
                        self.finished.add(chunk.rid)
                        check_result(chunk.result)
                    yield k, chunk
            finally:
                for task in tasks:
                    task.cancel()

    async def _final(self, q: asyncio.Queue) -> GenerateResult:
        while True:
            chunk = _unwrap(await q.get())
            if chunk.finished:
                self.finished.add(chunk.rid)
                return chunk.result

    def _watching(self):
        return _DisconnectWatch(self)


class _DisconnectWatch:
    """While inside: a client disconnect aborts the group at once. On the way out, anything
    of the group still running is aborted (a no-op for parts that finished)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> None:
        self.task = asyncio.create_task(self._watch())

    async def __aexit__(self, *exc_info) -> None:
        if self.task is not None:
            self.task.cancel()
        unfinished = self.group.unfinished()
        if unfinished:
            self.group.worker.abort(unfinished, "the request ended early", "client")

    async def _watch(self) -> None:
        receive = self.group.request.receive
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.group.worker.abort(self.group.rids, "the client disconnected", "client")
                return


def _unwrap(item) -> StreamChunk:
    if isinstance(item, EngineDeadError):
        raise APIError(503, str(item), code="engine_dead")
    return item
