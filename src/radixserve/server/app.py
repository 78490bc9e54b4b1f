"""The HTTP server: an OpenAI-compatible API, native /generate, /metrics, /health, cache control.

It only validates, tokenizes and streams; scheduling happens on the engine thread
(`EngineWorker`). Every error is an OpenAI-style body, `{"error": {"message", "type", "param",
"code"}}`: a 4xx that names the field for the client's mistakes, a 5xx with the request id for
the server's. Every response carries an `x-request-id` header. A client that disconnects has
its whole request aborted within one engine step.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.engine import Engine
from radixserve.errors import InvalidArgumentError
from radixserve.server.dispatch import Dispatcher, new_request_id
from radixserve.server.errors import APIError, error_response
from radixserve.server.metrics import ServerMetrics
from radixserve.server.native import add_native_routes
from radixserve.server.openai_api import add_openai_routes
from radixserve.server.worker import BusyError, EngineWorker

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 2**20
_TYPE_TAG = re.compile(r"str|int|float|bool|[a-z_-]+\[.*\]")
_OPEN_PATHS = ("/health", "/metrics")


def create_app(
    engine: Engine,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queued_requests: int = 1024,
    max_body_bytes: int = MAX_BODY_BYTES,
    request_timeout: float | None = None,
    watchdog: float | None = 60.0,
    prepare_threads: int = 2,
    on_engine_failure: Callable[[BaseException], None] | None = None,
    kv_events_endpoint: str | None = None,
    kv_events_replay_endpoint: str | None = None,
) -> FastAPI:
    """A FastAPI app serving `engine`; the engine thread starts and stops with the app.

    `app.state.worker.drain(timeout)` is the graceful shutdown: new requests get 503, running
    ones finish or are aborted at the timeout. `on_engine_failure` is called (on the engine
    thread) if the engine thread dies; the process should then exit non-zero.
    `kv_events_endpoint` (a ZMQ address, e.g. tcp://127.0.0.1:5557) publishes the tree's KV
    events, and needs an engine built with `enable_kv_events`.
    """
    model_name = served_model_name or engine.model_name
    metrics = ServerMetrics()
    publisher = None
    if kv_events_endpoint is not None:
        if not engine.cache.enable_kv_events:
            raise InvalidArgumentError("kv_events_endpoint needs Engine(enable_kv_events=True)")
        from radixserve.server.kv_events import KVEventPublisher

        medium = "GPU" if engine.device.type == "cuda" else "CPU"
        publisher = KVEventPublisher(kv_events_endpoint, kv_events_replay_endpoint, medium=medium)
    worker = EngineWorker(
        engine,
        max_queued_requests,
        request_timeout=request_timeout,
        watchdog=watchdog,
        on_chunk=metrics.on_chunk,
        on_fatal=on_engine_failure,
        kv_events=publisher,
    )
    metrics.watch(worker)
    dispatcher = Dispatcher(engine, worker, prepare_threads)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            worker.stop()
            dispatcher.close()
            if publisher is not None:
                publisher.close()

    app = FastAPI(title="radixserve", lifespan=lifespan)
    app.state.worker, app.state.engine, app.state.metrics = worker, engine, metrics

    def refusal() -> str | None:
        if worker.accepting:
            return None
        if worker.failure is not None:
            return "the engine has failed; the server is restarting"
        return "the server is shutting down; try another replica"

    add_guards(app, api_key, max_body_bytes, refusal)
    add_openai_routes(app, engine, dispatcher, model_name, int(time.time()))
    add_native_routes(app, dispatcher)

    @app.get("/health")
    async def health():
        """200 while the engine serves; 503 when it is dead, stuck, or the server is draining."""
        healthy, details = worker.health()
        return JSONResponse(details, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache(scope: str = "device"):
        """Empty the KV tiers `scope` names: device (the radix tree, the default), host,
        storage (this model's pages only), or all."""
        scopes = ("device", "host", "storage", "all")
        if scope not in scopes:
            raise APIError(400, f"scope must be one of {scopes}, got {scope!r}", "scope")

        def flush(engine: Engine) -> dict:
            flushed = {}
            if scope in ("device", "all"):
                if engine.has_work() or engine.cache.protected_size():
                    raise BusyError("requests are running; the cache can be flushed only when idle")
                flushed["flushed_tokens"] = engine.cache.total_size()
                engine.cache.reset()
            if scope in ("host", "all") and engine.host_tier is not None:
                flushed["flushed_host_pages"] = engine.host_tier.clear()
            return flushed

        def flush_storage() -> dict:
            """Off the engine thread: removing a store's files takes I/O."""
            storage_io = worker.engine.storage_io
            if scope not in ("storage", "all") or storage_io is None:
                return {}
            storage_io.flush(30)  # writes already started land first, then go
            return {"flushed_storage_pages": storage_io.tier.clear()}

        try:
            flushed = await worker.call(flush)
        except BusyError as exc:
            raise APIError(409, str(exc)) from None
        return flushed | await asyncio.to_thread(flush_storage)

    return app


def add_guards(
    app: FastAPI,
    api_key: str | None,
    max_body_bytes: int,
    refuse: Callable[[], str | None],
) -> None:
    """Request ids, the API key, the body size cap, 503 while `refuse()` gives a reason, and
    every error (validation, routing, APIError, a bug) as an OpenAI-style body."""

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes, refuse=refuse)

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

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        # Routing and body-parsing errors (404, 405, a body nested too deep to parse).
        message = exc.detail if isinstance(exc.detail, str) else "invalid request"
        if exc.status_code == 400 and "parsing the body" in message:
            message = "the request body could not be parsed as JSON (nested too deep?)"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):
        rid = getattr(request.state, "request_id", "?")
        log.exception("request %s failed", rid)
        message = f"internal error ({type(exc).__name__}); request id {rid}"
        return error_response(500, message, code="internal_error", headers={"x-request-id": rid})


class _Guard:
    """`add_guards`' checks as plain ASGI middleware, which passes a streamed body through
    untouched (Starlette's `BaseHTTPMiddleware` relays every chunk between two tasks)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, refuse) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.refuse = refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["request_id"] = rid = new_request_id()
        headers = Headers(scope=scope)
        reply = None
        authorized = headers.get("authorization") == f"Bearer {self.api_key}"
        length = headers.get("content-length")
        if self.api_key is not None and scope["path"] not in _OPEN_PATHS and not authorized:
            reply = error_response(401, "missing or wrong API key", code="invalid_api_key")
        elif length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            reply = error_response(413, f"request body exceeds {self.max_body_bytes} bytes")
        elif scope["method"] == "POST" and (message := self.refuse()) is not None:
            reply = error_response(503, message, code="unavailable")
        tag = (b"x-request-id", rid.encode())

        async def send_tagged(message) -> None:
            if message["type"] == "http.response.start":
                kept = [h for h in message.get("headers", ()) if h[0].lower() != tag[0]]
                message = {**message, "headers": [*kept, tag]}
            await send(message)

        app = reply if reply is not None else self.app
        await app(scope, receive, send_tagged)
