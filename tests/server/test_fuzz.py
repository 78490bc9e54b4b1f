"""Fuzzed request bodies on both APIs: every answer is a 2xx or a 4xx in the OpenAI error
shape, streams end with [DONE], and the server stays healthy with nothing leaked."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import LiveServer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from model_helpers import byte_checkpoint

from radixserve.engine import Engine

pytest.importorskip("xgrammar", reason="structured output needs the xgrammar extra")

EXAMPLES = 120

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def maybe(good):
    """Mostly a plausible value (7 in 8), sometimes anything at all."""
    return st.integers(0, 7).flatmap(lambda i: anything if i == 0 else good)


small_schema = st.sampled_from(
    [
        {"type": "object"},
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}},
        {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"]},
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        {"type": "objectx"},
        {"$ref": "#/nowhere"},
        {"type": "string", "pattern": "[a-"},
    ]
)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "text"])}),
)
message = st.fixed_dictionaries(
    {
        "role": maybe(st.sampled_from(["system", "user", "assistant", "developer", "tool"])),
        "content": maybe(st.one_of(st.text(max_size=30), st.lists(part, max_size=3), st.none())),
    },
    optional={
        "name": maybe(st.text(max_size=8)),
        "tool_call_id": maybe(st.text(max_size=8)),
        "tool_calls": maybe(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "id": st.text(max_size=5),
                        "type": st.just("function"),
                        "function": st.fixed_dictionaries(
                            {
                                "name": st.text(max_size=8),
                                "arguments": st.sampled_from(["{}", '{"a": 1}', "{x", "[]"]),
                            }
                        ),
                    }
                ),
                max_size=2,
            )
        ),
    },
)
tool = st.fixed_dictionaries(
    {
        "type": maybe(st.just("function")),
        "function": maybe(
            st.fixed_dictionaries(
                {"name": maybe(st.sampled_from(["f", "get_x", "bad name", ""]))},
                optional={"parameters": maybe(small_schema)},
            )
        ),
    }
)
response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "yaml"])}),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": maybe(
                st.fixed_dictionaries({"name": st.text(max_size=6), "schema": maybe(small_schema)})
            ),
        }
    ),
)
sampling = {
    "temperature": maybe(st.floats(0, 2)),
    "top_p": maybe(st.floats(0, 1)),
    "top_k": maybe(st.integers(0, 50)),
    "n": maybe(st.integers(1, 3)),
    "seed": maybe(st.integers(0, 2**63)),
    "stop": maybe(st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3))),
    "stream": st.booleans(),
    "presence_penalty": maybe(st.floats(-2, 2)),
    "frequency_penalty": maybe(st.floats(-2, 2)),
    "logprobs": anything,
    "user": maybe(st.text(max_size=5)),
}
chat_body = st.fixed_dictionaries(
    {"messages": maybe(st.lists(message, min_size=1, max_size=3))},
    optional={
        "max_tokens": maybe(st.integers(0, 24)),
        "response_format": maybe(response_format),
        "tools": maybe(st.lists(tool, max_size=2)),
        "tool_choice": maybe(
            st.one_of(
                st.sampled_from(["none", "auto", "required"]),
                st.fixed_dictionaries(
                    {
                        "type": st.just("function"),
                        "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])}),
                    }
                ),
            )
        ),
        "parallel_tool_calls": anything,
        "top_logprobs": anything,
        "stream_options": anything,
        **sampling,
    },
)
completion_body = st.fixed_dictionaries(
    {
        "prompt": maybe(
            st.one_of(
                st.text(min_size=1, max_size=30),
                st.lists(st.integers(0, 263), min_size=1, max_size=6),
                st.lists(st.text(max_size=8), max_size=3),
            )
        )
    },
    optional={
        **sampling,
        "max_tokens": maybe(st.integers(0, 24)),
        "echo": maybe(st.just(False)),
        "logprobs": maybe(st.integers(0, 5)),
    },
)
generate_params = maybe(
    st.fixed_dictionaries(
        {},
        optional={
            "max_new_tokens": maybe(st.integers(0, 24)),
            "temperature": maybe(st.floats(0, 2)),
            "regex": maybe(st.sampled_from(["[0-9]{2}", "a|b", "(["])),
            "ebnf": maybe(st.sampled_from(['root ::= "x"', "root ::= y"])),
            "json_schema": maybe(small_schema),
            "stop_token_ids": anything,
            "ignore_eos": anything,
        },
    )
)
generate_body = st.one_of(
    st.fixed_dictionaries(
        {"text": maybe(st.text(min_size=1, max_size=30))},
        optional={"stream": st.booleans(), "sampling_params": generate_params},
    ),
    st.fixed_dictionaries(
        {"input_ids": maybe(st.lists(st.integers(-2, 300), min_size=1, max_size=6))},
        optional={"stream": st.booleans(), "sampling_params": generate_params},
    ),
    st.dictionaries(st.sampled_from(["text", "input_ids", "stream", "x"]), anything, max_size=3),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = byte_checkpoint(tmp_path_factory.mktemp("fuzz"))
    live = LiveServer(Engine(str(path), dtype="float32"), max_body_bytes=64_000)
    yield live
    live.stop()


def _check(server, path: str, body) -> None:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], body
        assert error["type"] == "invalid_request_error" or response.status_code == 404, body
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]", body
        for event in events[:-1]:
            item = json.loads(event.removeprefix("data: "))
            if "error" in item:  # an error after the stream began: a client's fault only
                assert item["error"]["type"] == "invalid_request_error", (body, item)
    else:
        response.json()


_settings = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
    database=None,  # the same examples on every machine
)


@_settings
@given(body=chat_body)
def test_fuzzed_chat_bodies_never_get_a_5xx(server, body):
    _check(server, "/v1/chat/completions", body)


@_settings
@given(body=completion_body)
@example(body={"prompt": "0", "temperature": 5e-324})  # was a 500: logits / 5e-324 = inf
@example(body={"prompt": "0", "top_p": 5e-324})  # was a 500: no token kept
def test_fuzzed_completion_bodies_never_get_a_5xx(server, body):
    _check(server, "/v1/completions", body)


@_settings
@given(body=generate_body)
def test_fuzzed_generate_bodies_never_get_a_5xx(server, body):
    _check(server, "/generate", body)


def test_after_the_fuzz_the_server_is_healthy_and_whole(server):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    server.idle_check()
