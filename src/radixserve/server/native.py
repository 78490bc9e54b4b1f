"""The native route, /generate: text or input ids, engine sampling parameters, `meta_info`."""

from __future__ import annotations

from fastapi import FastAPI, Request

from radixserve.engine import GenerateResult
from radixserve.server.dispatch import Dispatcher
from radixserve.server.errors import APIError
from radixserve.server.protocol import GenerateRequest
from radixserve.server.sse import sse


def add_native_routes(app: FastAPI, dispatcher: Dispatcher) -> None:
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", "text")
        prompt = body.text if body.text is not None else body.input_ids
        group = await dispatcher.start(request, [(prompt, body.sampling_params)])
        if body.stream:

            async def native_stream():
                async for _, chunk in group.chunks():
                    item = {"text": chunk.text, "output_ids": chunk.token_ids}
                    if chunk.finished:
                        item["meta_info"] = _meta(chunk.result)
                    yield item

            return sse(native_stream())
        [result] = await group.results()
        return {"text": result.text, "output_ids": result.token_ids, "meta_info": _meta(result)}


def _meta(result: GenerateResult) -> dict:
    return {
        "id": result.rid,
        "prompt_tokens": result.usage.prompt_tokens,
        "completion_tokens": result.usage.completion_tokens,
        "cached_tokens": result.usage.cached_tokens,
        "host_cached_tokens": result.meta.get("host_tokens", 0),
        "storage_cached_tokens": result.meta.get("storage_tokens", 0),
        "finish_reason": result.finish_reason,
        "matched_stop": result.meta.get("matched_stop"),
        "error": result.error,
        "queue_time": result.meta.get("queue_time"),
        "ttft": result.meta.get("ttft"),
        "e2e_latency": result.meta.get("e2e"),
    }
