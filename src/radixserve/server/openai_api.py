"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions and /v1/models.

Chat takes content parts, `response_format` (JSON mode and JSON schema, enforced by a grammar)
and `tools` / `tool_choice` / `parallel_tool_calls` (calls parsed back into `tool_calls`, and
forced by a grammar for `required` or a named function).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request

from radixserve.engine import Engine, GenerateResult, StreamChunk
from radixserve.server.dispatch import Dispatcher, Group
from radixserve.server.errors import APIError
from radixserve.server.messages import template_messages
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.server.sse import sse
from radixserve.server.tools import ToolCallParser, check_tools, chosen_tools, tool_format


@dataclass(frozen=True)
class _Shape:
    """How one endpoint frames its answers: a final choice, a streamed delta, the usage."""

    kind: str  # "chat" or "completion"
    choice: Callable[[int, GenerateResult], dict]
    delta: Callable[[int, StreamChunk], dict]
    usage: Callable[[list[GenerateResult]], dict]


def add_openai_routes(
    app: FastAPI, engine: Engine, dispatcher: Dispatcher, model_name: str, created: int
) -> None:
    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {model_name!r}",
                "model",
                "model_not_found",
            )

    async def respond(request: Request, body, group: Group, shape: _Shape):
        """One JSON body, or an SSE stream, for the started `group`."""
        cid = f"{'chatcmpl' if shape.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion" if shape.kind == "chat" else "text_completion"

        def frame(choices, **extra):
            return {
                "id": cid,
                "object": f"{obj}.chunk" if shape.kind == "chat" else obj,
                "created": int(time.time()),
                "model": model_name,
                "choices": choices,
                **extra,
            }

        if not body.stream:
            results = await group.results()
            return {
                "id": cid,
                "object": obj,
                "created": int(time.time()),
                "model": model_name,
                "choices": [shape.choice(k, r) for k, r in enumerate(results)],
                "usage": shape.usage(results),
            }
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[dict]:
            if shape.kind == "chat":
                for k in range(len(group.rids)):
                    role = {"role": "assistant", "content": ""}
                    yield frame([_choice_delta(k, role, None)])
            finals: list = [None] * len(group.rids)
            async for k, chunk in group.chunks():
                if chunk.finished:
                    finals[k] = chunk.result
                if chunk.text or chunk.finished:
                    yield frame([shape.delta(k, chunk)])
            if include_usage:
                yield frame([], usage=shape.usage(finals))

        return sse(events())

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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        params = sampling(body, body.max_tokens, body.logprobs)
        jobs = [(p, _seeded(params, i)) for p in _prompt_list(body.prompt) for i in range(body.n)]
        group = await dispatcher.start(request, jobs)
        shape = _Shape(
            "completion",
            lambda k, r: {
                "index": k,
                "text": r.text,
                "logprobs": _completion_logprobs(engine, r) if body.logprobs is not None else None,
                "finish_reason": _finish_reason(r),
            },
            lambda k, chunk: {
                "index": k,
                "text": chunk.text,
                "logprobs": None,
                "finish_reason": _finish_reason(chunk.result) if chunk.finished else None,
            },
            lambda results: _sum_usage(results, body.n),
        )
        return await respond(request, body, group, shape)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = 256
        all_tools = check_tools(body.tools or [])
        tools, mode = chosen_tools(all_tools, body.tool_choice)
        fmt = tool_format(engine.tokenizer.chat_template)
        shown = all_tools if mode != "none" else []
        messages, template_args = template_messages(body.messages, fmt, shown)
        prompt = await dispatcher.chat_prompt(messages, **template_args)
        top = body.top_logprobs if body.logprobs else None
        params = sampling(body, max_tokens, (top or 0) if body.logprobs else None)
        grammar = _response_grammar(body)
        if mode in ("required", "forced"):
            if grammar is not None:
                raise APIError(
                    400,
                    "response_format cannot be combined with tool_choice "
                    f"{body.tool_choice!r}: the output is a tool call",
                    "response_format",
                )
            grammar = ("structural_tag", fmt.grammar(tools, mode, body.parallel_tool_calls))
        if grammar is not None:
            params[grammar[0]] = grammar[1]
        group = await dispatcher.start(
            request,
            [(prompt, _seeded(params, i)) for i in range(body.n)],
            grammar_param="tools" if mode in ("required", "forced") else "response_format",
        )
        parsers = [
            fmt.parser(tools, body.parallel_tool_calls) if mode != "none" else None
            for _ in range(body.n)
        ]
        return await respond(request, body, group, _chat_shape(parsers))

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": model_name, "object": "model", "created": created, "owned_by": "radixserve"}
            ],
        }


def _chat_shape(parsers: list[ToolCallParser | None]) -> _Shape:
    """Chat answers; with tools, each choice's text is split into content and tool calls."""

    def choice(k: int, r: GenerateResult) -> dict:
        message: dict = {"role": "assistant", "content": r.text}
        reason = _finish_reason(r)
        if parsers[k] is not None:
            content, calls = parsers[k].parse(r.text)
            if calls:
                message = {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [c.as_openai() for c in calls],
                }
                reason = "tool_calls"
        return {"index": k, "message": message, "logprobs": None, "finish_reason": reason}

    counts = [0] * len(parsers)

    def delta(k: int, chunk: StreamChunk) -> dict:
        parser = parsers[k]
        if parser is None:
            reason = _finish_reason(chunk.result) if chunk.finished else None
            return _choice_delta(k, {"content": chunk.text} if chunk.text else {}, reason)
        text, calls = parser.feed(chunk.text)
        if chunk.finished:
            more, last = parser.finish()
            text, calls = text + more, calls + last
        out: dict = {"content": text} if text else {}
        if calls:
            out["tool_calls"] = [c.as_openai(counts[k] + i) for i, c in enumerate(calls)]
            counts[k] += len(calls)
        reason = None
        if chunk.finished:
            reason = "tool_calls" if counts[k] else _finish_reason(chunk.result)
        return _choice_delta(k, out, reason)

    return _Shape("chat", choice, delta, _usage)


def _response_grammar(body: ChatCompletionRequest) -> tuple[str, str] | None:
    """The (sampling param, grammar) `response_format` asks for, or None."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "json_schema", '{"type": "object"}'
    spec = fmt.json_schema
    if spec is None:
        raise APIError(400, "response_format json_schema needs a 'json_schema'", "response_format")
    schema = spec.schema_ if spec.schema_ is not None else {"type": "object"}
    return "json_schema", json.dumps(schema)


def _choice_delta(k: int, delta: dict, finish_reason: str | None) -> dict:
    return {"index": k, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _finish_reason(result: GenerateResult) -> str:
    return "stop" if result.finish_reason == "stop" else "length"


def _seeded(params: dict, i: int) -> dict:
    if params.get("seed") is not None and i:
        return {**params, "seed": params["seed"] + i}
    return params


def _prompt_list(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt)


def _usage(results: list[GenerateResult]) -> dict:
    """One prompt's usage: its tokens once, however many choices it has."""
    prompt = sum(r.usage.prompt_tokens for r in results[:1])
    completion = sum(r.usage.completion_tokens for r in results)
    cached = max((r.usage.cached_tokens for r in results), default=0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _sum_usage(results: list[GenerateResult], n: int) -> dict:
    groups = [results[i : i + n] for i in range(0, len(results), n)]
    parts = [_usage(g) for g in groups]
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
