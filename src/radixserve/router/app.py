"""An HTTP router in front of several `radixserve serve` backends.

It speaks the same API (`/v1/completions`, `/v1/chat/completions`, `/generate`, streaming
passed through byte for byte), picks a backend per request with a
`radixserve.sched.routing` policy, and, for `precise`, follows each backend's KV events over
ZMQ. It tokenizes prompts with the served model's tokenizer and chat template, so page
digests match the backends' trees for plain prompts and chats (a request with tools is
rendered differently by the backend; it is then routed as if it had no cached prefix).

Load, liveness and KV event expiry are `router.state.Router`'s. A backend that refuses
connections is marked down, and the request goes to the next choice; when every backend is
down the client gets a 503.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixserve.model.tokenizer import TextTokenizer
from radixserve.router.state import Router, follow_events
from radixserve.server.errors import error_response

log = logging.getLogger(__name__)

_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")


def prompt_ids(tokenizer: TextTokenizer, path: str, body: dict) -> list[int]:
    """The token ids the backend will see for `body` (empty when unknown)."""
    try:
        if path == "/v1/chat/completions":
            if body.get("tools"):
                return []
            messages = [
                {"role": m.get("role"), "content": _text(m.get("content"))}
                for m in body.get("messages") or []
            ]
            text = tokenizer.apply_chat_template(messages)
            return tokenizer.encode(text, add_special_tokens=False)
        prompt = body.get("input_ids") if path == "/generate" else body.get("prompt")
        if path == "/generate" and prompt is None:
            prompt = body.get("text")
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
    except (ValueError, TypeError, AttributeError):
        pass
    return []


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def create_router_app(
    backends: Sequence[str],
    policy: str,
    tokenizer: TextTokenizer,
    kv_event_endpoints: Sequence[str] | None = None,
    page_size: int = 1,
    timeout: float = 600.0,
    events_timeout: float = 10.0,
) -> FastAPI:
    """A FastAPI app routing the serving API over `backends` (their base URLs)."""
    router = Router(backends, policy, page_size, events_timeout=events_timeout)
    if kv_event_endpoints and len(kv_event_endpoints) != len(backends):
        raise ValueError("give one KV events endpoint per backend")
    client = httpx.AsyncClient(timeout=timeout)
    stop = threading.Event()
    threads = [
        threading.Thread(target=follow_events, args=(router, k, ep, stop), daemon=True)
        for k, ep in enumerate(kv_event_endpoints or [])
    ]

    async def lifespan(app: FastAPI):
        for thread in threads:
            thread.start()
        yield
        stop.set()
        await client.aclose()

    app = FastAPI(title="radixserve router", lifespan=lifespan)
    app.state.router = router

    async def forward(path: str, request: Request):
        raw = await request.body()
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        ids = await asyncio.to_thread(prompt_ids, tokenizer, path, body)
        session = request.headers.get("x-session-id") or body.get("user")
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization",)}
        headers["content-type"] = "application/json"
        for k in router.order(ids, session if isinstance(session, str) else None):
            backend = router.backends[k]
            rid = router.start(k, len(ids))
            try:
                upstream = await client.send(
                    client.build_request("POST", backend.url + path, content=raw, headers=headers),
                    stream=True,
                )
            except httpx.TransportError as exc:
                router.end(k, rid)
                router.mark_down(k)
                log.warning("backend %s failed (%s); trying the next", backend.url, exc)
                continue
            return _relay(upstream, lambda k=k, rid=rid: router.end(k, rid))
        return error_response(503, "no backend is reachable", code="no_backend")

    for path in _ROUTES:
        app.add_api_route(path, _bind(forward, path), methods=["POST"])

    @app.get("/health")
    async def health():
        now = time.monotonic()
        up = [b.url for b in router.backends if b.down_until <= now]
        status = 200 if up else 503
        return JSONResponse({"backends_up": up, "policy": policy}, status)

    @app.get("/router/stats")
    async def stats():
        return {
            "policy": policy,
            "backends": [
                {"url": b.url, "routed": b.routed, "in_flight": len(b.in_flight)}
                for b in router.backends
            ],
        }

    return app


def _bind(forward, path: str):
    async def route(request: Request):
        return await forward(path, request)

    return route


def _relay(upstream: httpx.Response, done) -> Response:
    """The backend's answer as it comes, status and content type kept."""

    async def body():
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            done()

    media = upstream.headers.get("content-type", "application/json")
    keep = {k: v for k, v in upstream.headers.items() if k.lower() == "x-request-id"}
    return StreamingResponse(
        body(), status_code=upstream.status_code, media_type=media, headers=keep
    )
