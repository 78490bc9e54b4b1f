"""The HTTP server: an OpenAI-compatible API, native /generate, /metrics and cache control.

It only validates, tokenizes and streams; scheduling happens on the engine thread
(`EngineWorker`). Every error is an OpenAI-style body with a 4xx status that names the field:
`{"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}`.
A client that disconnects has its request aborted, so its slots are freed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixserve.engine import Engine, GenerateResult, StreamChunk
from radixserve.errors import InvalidArgumentError
from radixserve.server.metrics import ServerMetrics
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from radixserve.server.worker import BusyError, EngineWorker, QueueFullError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 2**20
_TYPE_TAG = re.compile(r"str|int|float|bool|[a-z_-]+\[.*\]")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code=None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param=None, code=None, kind=None) -> JSONResponse:
    kind = kind or ("authentication_error" if status == 401 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def create_app(
    engine: Engine,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queued_requests: int = 1024,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """A FastAPI app serving `engine`; the engine thread starts and stops with the app."""
    model_name = served_model_name or engine.model_name
    metrics = ServerMetrics(engine)
    worker = EngineWorker(engine, max_queued_requests, on_chunk=metrics.on_chunk)
    ids = itertools.count()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="radixserve", lifespan=lifespan)
    app.state.worker, app.state.engine, app.state.metrics = worker, engine, metrics

    @app.middleware("http")
    async def guard(request: Request, call_next):
        authorized = request.headers.get("authorization") == f"Bearer {api_key}"
        if api_key is not None and request.url.path != "/health" and not authorized:
            return error_response(401, "missing or wrong API key", code="invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            return error_response(413, f"request body exceeds {max_body_bytes} bytes")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        # Drop "body" and the union-member tags pydantic adds (e.g. prompt.str, prompt.list[int]).
        loc = [
            str(p) for p in first.get("loc", ()) if p != "body" and not _TYPE_TAG.fullmatch(str(p))
        ]
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON")
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        return error_response(400, f"{param}: {message}" if param else message, param=param)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {model_name!r}",
                "model",
                "model_not_found",
            )

    async def start(prompt, params: dict) -> tuple[str, asyncio.Queue]:
        rid = f"req-{next(ids)}-{uuid.uuid4().hex[:8]}"
        try:
            return rid, await worker.submit(prompt, params, rid)
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full") from None
        except InvalidArgumentError as exc:
            raise APIError(400, str(exc), _param_of(exc)) from None

    async def collect(request: Request, rid: str, q: asyncio.Queue) -> GenerateResult:
        """Wait for the final chunk, aborting the request if the client goes away."""
        while True:
            try:
                chunk = await asyncio.wait_for(q.get(), timeout=0.25)
            except TimeoutError:
                if await request.is_disconnected():
                    worker.abort(rid)
                    raise APIError(499, "client disconnected") from None
                continue
            if chunk.finished:
                return chunk.result

    async def stream_chunks(rid: str, q: asyncio.Queue) -> AsyncIterator[StreamChunk]:
        try:
            while True:
                chunk = await q.get()
                yield chunk
                if chunk.finished:
                    return
        finally:
            worker.abort(rid)  # a no-op once finished; frees the slots of a gone client

    # -- OpenAI completions ---------------------------------------------------------------

    def sampling(body, max_tokens: int, logprobs: int | None) -> dict:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return {
            "max_new_tokens": max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "stop": stop,
            "seed": body.seed,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty,
            "ignore_eos": body.ignore_eos,
            "logprobs": logprobs,
        }

    def usage(results: list[GenerateResult]) -> dict:
        prompt = sum(r.usage.prompt_tokens for r in results[:1])
        completion = sum(r.usage.completion_tokens for r in results)
        cached = max((r.usage.cached_tokens for r in results), default=0)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def finish_reason(result: GenerateResult) -> str:
        if result.finish_reason == "abort":
            raise APIError(
                500 if "memory" in (result.error or "") else 400,
                result.error or "the request was aborted",
            )
        return "stop" if result.finish_reason == "stop" else "length"

    def seeded(params: dict, i: int) -> dict:
        if params.get("seed") is not None and i:
            return {**params, "seed": params["seed"] + i}
        return params

    async def respond(request, body, started, kind: str, choice, usage_of, delta):
        """The OpenAI response for `started` requests: one JSON body, or an SSE stream.

        `choice(k, result)` builds a final choice, `delta(k, chunk)` a streamed one; a chat
        stream opens each choice with the assistant role.
        """
        cid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion" if kind == "chat" else "text_completion"

        def frame(choices, **extra):
            chunk_obj = f"{obj}.chunk" if kind == "chat" else obj
            return {
                "id": cid,
                "object": chunk_obj,
                "created": int(time.time()),
                "model": model_name,
                "choices": choices,
                **extra,
            }

        if not body.stream:
            results = [await collect(request, rid, q) for rid, q in started]
            return {
                "id": cid,
                "object": obj,
                "created": int(time.time()),
                "model": model_name,
                "choices": [choice(k, r) for k, r in enumerate(results)],
                "usage": usage_of(results),
            }
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[dict]:
            if kind == "chat":
                for k in range(len(started)):
                    yield frame(
                        [
                            {
                                "index": k,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
            finals: list = []
            merged = _merge_streams(
                started, stream_chunks, lambda k, chunk: frame([delta(k, chunk)]), finals
            )
            async for item in merged:
                yield item
            if include_usage:
                yield frame([], usage=usage_of(finals))

        return sse(events())

    def stream_finish(chunk: StreamChunk) -> str | None:
        return finish_reason(chunk.result) if chunk.finished else None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        params = sampling(body, body.max_tokens, body.logprobs)
        jobs = [(p, i) for p in _prompt_list(body.prompt) for i in range(body.n)]
        started = [await start(p, seeded(params, i)) for p, i in jobs]
        return await respond(
            request,
            body,
            started,
            "completion",
            lambda k, r: {
                "index": k,
                "text": r.text,
                "logprobs": _completion_logprobs(engine, r) if body.logprobs is not None else None,
                "finish_reason": finish_reason(r),
            },
            lambda results: _sum_usage(results, body.n, usage),
            lambda k, chunk: {
                "index": k,
                "text": chunk.text,
                "logprobs": None,
                "finish_reason": stream_finish(chunk),
            },
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = 256
        try:
            text = engine.tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
        except InvalidArgumentError as exc:
            raise APIError(400, str(exc), "messages") from None
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        top = body.top_logprobs if body.logprobs else None
        params = sampling(body, max_tokens, (top or 0) if body.logprobs else None)
        started = [await start(prompt, seeded(params, i)) for i in range(body.n)]
        return await respond(
            request,
            body,
            started,
            "chat",
            lambda k, r: {
                "index": k,
                "message": {"role": "assistant", "content": r.text},
                "logprobs": None,
                "finish_reason": finish_reason(r),
            },
            usage,
            lambda k, chunk: {
                "index": k,
                "delta": {"content": chunk.text} if chunk.text else {},
                "logprobs": None,
                "finish_reason": stream_finish(chunk),
            },
        )

    # -- native and service endpoints -----------------------------------------------------

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", "text")
        prompt = body.text if body.text is not None else body.input_ids
        rid, q = await start(prompt, body.sampling_params)
        if body.stream:

            async def native_stream():
                async for chunk in stream_chunks(rid, q):
                    item = {"text": chunk.text, "output_ids": chunk.token_ids}
                    if chunk.finished:
                        item["meta_info"] = _meta(chunk.result)
                    yield item

            return sse(native_stream())
        result = await collect(request, rid, q)
        return {"text": result.text, "output_ids": result.token_ids, "meta_info": _meta(result)}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": model_name, "object": "model", "created": created, "owned_by": "radixserve"}
            ],
        }

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache():
        def flush(engine: Engine) -> int:
            if engine.has_work() or engine.cache.protected_size():
                raise BusyError("requests are running; the cache can be flushed only when idle")
            freed = engine.cache.total_size()
            engine.cache.reset()
            return freed

        try:
            freed = await worker.call(flush)
        except BusyError as exc:
            raise APIError(409, str(exc)) from None
        return {"flushed_tokens": freed}

    return app


def sse(items: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for item in items:
                yield f"data: {json.dumps(item)}\n\n"
        except APIError as exc:
            err = {
                "error": {
                    "message": exc.message,
                    "type": "invalid_request_error",
                    "param": exc.param,
                    "code": exc.code,
                }
            }
            yield f"data: {json.dumps(err)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _merge_streams(started, stream_chunks, frame, results: list):
    """Interleave several requests' chunks as they come, framing each; fills `results`."""
    queue: asyncio.Queue = asyncio.Queue()
    results[:] = [None] * len(started)

    async def pump(k, rid, q):
        async for chunk in stream_chunks(rid, q):
            await queue.put((k, chunk))

    tasks = [asyncio.create_task(pump(k, rid, q)) for k, (rid, q) in enumerate(started)]
    try:
        done = 0
        while done < len(started):
            k, chunk = await queue.get()
            if chunk.finished:
                done += 1
                results[k] = chunk.result
            if chunk.text or chunk.finished:
                yield frame(k, chunk)
    finally:
        for task in tasks:
            task.cancel()


def _prompt_list(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt)


def _sum_usage(results, n, usage_of) -> dict:
    # One prompt's tokens count once per prompt, however many choices it has.
    groups = [results[i : i + n] for i in range(0, len(results), n)]
    parts = [usage_of(g) for g in groups]
    prompt = sum(p["prompt_tokens"] for p in parts)
    completion = sum(p["completion_tokens"] for p in parts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": sum(p["prompt_tokens_details"]["cached_tokens"] for p in parts)
        },
    }


def _completion_logprobs(engine: Engine, result: GenerateResult) -> dict:
    entries = result.logprobs or []
    return {
        "tokens": [engine.tokenizer.decode([e.token], skip_special_tokens=False) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            {
                engine.tokenizer.decode([t], skip_special_tokens=False): lp
                for t, lp in (e.top_logprobs or [])
            }
            for e in entries
        ],
        "text_offset": None,
    }


def _meta(result: GenerateResult) -> dict:
    return {
        "prompt_tokens": result.usage.prompt_tokens,
        "completion_tokens": result.usage.completion_tokens,
        "cached_tokens": result.usage.cached_tokens,
        "finish_reason": result.finish_reason,
        "matched_stop": result.meta.get("matched_stop"),
        "error": result.error,
        "queue_time": result.meta.get("queue_time"),
        "ttft": result.meta.get("ttft"),
        "e2e_latency": result.meta.get("e2e"),
    }


_API_NAMES = {"max_new_tokens": "max_tokens"}


def _param_of(exc: InvalidArgumentError) -> str | None:
    """The request field an engine error blames, under the API's name for it."""
    field = getattr(exc, "field", None)
    return _API_NAMES.get(field, field)
