"""Between an HTTP handler and the engine thread: preparing, submitting and following requests.

Tokenization, the chat template and request validation run in a small thread pool, off both
the event loop and the engine thread. One HTTP request (several prompts, `n` choices) becomes a
`Group` of engine requests that is submitted whole or not at all, and that ends whole: when
the client disconnects, when one part fails, or when the handler stops reading, every part
still running is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
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
        parts = await self.prepare(request.state.request_id, jobs)
        return await self.submit(parts, grammar_param, request)

    async def prepare(
        self, request_id: str, jobs: Sequence[tuple[str | list[int], dict]]
    ) -> list[Part]:
        """The jobs validated and encoded (a 400 naming the field for bad input)."""

        def build() -> list[Part]:
            return [
                Part(*self.engine.prepare_request(prompt, params), f"{request_id}-{k}")
                for k, (prompt, params) in enumerate(jobs)
            ]

        return await self.off_thread(build)

    async def submit(
        self,
        parts: Sequence[Part],
        grammar_param: str | None = None,
        request: Request | None = None,
    ) -> Group:
        """Compile the parts' grammars, then queue them all or none. With `request`, a client
        disconnect aborts the group."""
        grammars = await self.off_thread(
            lambda: [self.engine.compile_grammar(p.params) for p in parts]
        )
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
        worker = self.worker
        return Group(
            request,
            [p.rid for p in parts],
            merged_batches(queues),
            lambda rids, message: worker.abort(rids, message, "client"),
        )


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


class Group:
    """The engine requests of one HTTP request, followed to their ends.

    `batches` yields lists of (part index, item) as they come, an item being a `StreamChunk`
    or the `EngineDeadError` that ends a part; `abort(rids, message)` stops parts early.
    Where they run (this process's engine or a remote replica) is theirs to know.
    """

    def __init__(
        self,
        request: Request | None,
        rids: list[str],
        batches: AsyncIterator[list[tuple[int, object]]],
        abort: Callable[[list[str], str], None],
    ) -> None:
        self.request, self.rids, self.abort = request, rids, abort
        self._batches = batches
        self.finished: set[str] = set()

    def unfinished(self) -> list[str]:
        return [rid for rid in self.rids if rid not in self.finished]

    async def results(self) -> list[GenerateResult]:
        """Every part's result, in order; the first failure raises its APIError."""
        finals: list = [None] * len(self.rids)
        async for k, chunk in self.chunks():
            if chunk.finished:
                finals[k] = chunk.result
        return finals

    async def chunks(self) -> AsyncIterator[tuple[int, StreamChunk]]:
        """(part index, chunk) as the engine produces them, until every part has finished;
        a part that failed raises its APIError."""
        async with contextlib.aclosing(self.batches()) as batches:
            async for batch in batches:
                for k, item in batch:
                    chunk = _unwrap(item)
                    if chunk.finished:
                        check_result(chunk.result)
                    yield k, chunk

    async def batches(self) -> AsyncIterator[list[tuple[int, object]]]:
        """The raw batches, until every part has finished or one item is an error. Leaving
        early (or a client disconnect) aborts the parts still running."""
        async with _DisconnectWatch(self):
            async for batch in self._batches:
                for _, item in batch:
                    if isinstance(item, StreamChunk) and item.finished:
                        self.finished.add(item.rid)
                yield batch
                if not self.unfinished() or any(
                    not isinstance(item, StreamChunk) for _, item in batch
                ):
                    return


async def merged_batches(queues: Sequence[asyncio.Queue]) -> AsyncIterator[list]:
    """What the engine thread delivers on each part's queue, merged into lists of (part
    index, item) of everything ready at once; ends when each part has had its last item."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, q: asyncio.Queue) -> None:
        while True:
            item = await q.get()
            await merged.put((k, item))
            if not isinstance(item, StreamChunk) or item.finished:
                return

    tasks = [asyncio.create_task(pump(k, q)) for k, q in enumerate(queues)]
    try:
        left = len(queues)
        while left:
            batch = [await merged.get()]
            while not merged.empty():
                batch.append(merged.get_nowait())
            left -= sum(not isinstance(i, StreamChunk) or i.finished for _, i in batch)
            yield batch
    finally:
        for task in tasks:
            task.cancel()


class _DisconnectWatch:
    """While inside: a client disconnect (when there is a client) aborts the group at once.
    On the way out, anything of the group still running is aborted (a no-op for parts that
    finished)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> None:
        if self.group.request is not None:
            self.task = asyncio.create_task(self._watch())

    async def __aexit__(self, *exc_info) -> None:
        if self.task is not None:
            self.task.cancel()
        unfinished = self.group.unfinished()
        if unfinished:
            self.group.abort(unfinished, "the request ended early")

    async def _watch(self) -> None:
        receive = self.group.request.receive
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.group.abort(self.group.rids, "the client disconnected")
                return


def _unwrap(item) -> StreamChunk:
    if isinstance(item, EngineDeadError):
        raise APIError(503, str(item), code="engine_dead")
    return item
