"""What OpenAI clients send, on a live server over a tiny random byte-level model: content
parts, JSON mode and JSON schemas, tools (forced, named, streamed, fed back), and /generate's
regex, ebnf and json_schema."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from conftest import LiveServer
from model_helpers import CHATML, CHATML_TOOLS, byte_checkpoint

from radixserve.engine import Engine

pytest.importorskip("xgrammar", reason="structured output needs the xgrammar extra")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": SCHEMA,
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _server(tmp_path_factory, template):
    path = byte_checkpoint(tmp_path_factory.mktemp("bytes"), chat_template=template)
    return LiveServer(Engine(str(path), dtype="float64"))


@pytest.fixture(scope="module", params=["fallback", "native"])
def live_bytes(request, tmp_path_factory):
    """Both a template that knows nothing of tools and one that renders them."""
    server = _server(tmp_path_factory, CHATML if request.param == "fallback" else CHATML_TOOLS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live_bytes):
    return openai.OpenAI(base_url=f"{live_bytes.url}/v1", api_key="unused", max_retries=0)


def _post(live, path, body):
    return httpx.post(f"{live.url}{path}", json=body, timeout=60)


# -- messages --------------------------------------------------------------------------------


def test_content_parts_are_concatenated_and_developer_is_system(live_bytes):
    as_parts = {
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {
                "role": "user",
                "name": "ana",
                "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
            },
        ],
        "max_tokens": 6,
        "temperature": 0,
    }
    as_text = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "name": "ana", "content": "Hi there"},
        ],
        "max_tokens": 6,
        "temperature": 0,
    }
    a, b = (
        _post(live_bytes, "/v1/chat/completions", as_parts),
        _post(live_bytes, "/v1/chat/completions", as_text),
    )
    assert a.status_code == b.status_code == 200
    assert a.json()["usage"]["prompt_tokens"] == b.json()["usage"]["prompt_tokens"]
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
    live_bytes.idle_check()


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file"])
def test_a_non_text_part_is_a_400_naming_its_type(live_bytes, kind):
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": kind}]}]
    }
    response = _post(live_bytes, "/v1/chat/completions", body)
    assert response.status_code == 400
    assert repr(kind) in response.json()["error"]["message"]


# -- structured output -----------------------------------------------------------------------


def test_json_schema_output_validates(client, live_bytes):
    for seed in range(4):
        reply = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True},
            },
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
        assert reply.choices[0].finish_reason == "stop"
    live_bytes.idle_check()


def test_json_mode_gives_an_object(client):
    reply = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=200,
        response_format={"type": "json_object"},
        n=2,
        temperature=0.5,
        seed=3,
    )
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut off by max_tokens, as OpenAI's JSON mode can be
            assert choice.message.content.startswith("{")


def test_streamed_json_schema_output_equals_the_plain_one(client):
    kwargs = dict(
        model="tiny",
        messages=ASK,
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}},
    )
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices
    )
    assert streamed == plain


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
        {"type": "json_schema"},
        {"type": "yaml"},
    ],
)
def test_a_bad_response_format_is_a_400(live_bytes, response_format):
    body = {"messages": ASK, "response_format": response_format, "stream": True}
    response = _post(live_bytes, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("response_format")
    live_bytes.idle_check()


def test_generate_takes_regex_ebnf_and_json_schema(live_bytes):
    cases = [
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"ebnf": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
        (
            {"json_schema": json.dumps(SCHEMA)},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True,
        ),
    ]
    for grammar, check in cases:
        body = {"text": "answer:", "sampling_params": {"max_new_tokens": 100, **grammar}}
        response = _post(live_bytes, "/generate", body)
        assert response.status_code == 200, response.text
        assert check(response.json()["text"]), response.json()["text"]
    bad = _post(live_bytes, "/generate", {"text": "x", "sampling_params": {"regex": "(["}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "regex"
    live_bytes.idle_check()


# -- tools -------------------------------------------------------------------------------------


def _check_calls(calls, names=("get_weather", "clock")):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        schema = WEATHER if call.function.name == "get_weather" else CLOCK
        jsonschema.validate(json.loads(call.function.arguments), schema["function"]["parameters"])


def test_required_tool_choice_gives_valid_calls(client, live_bytes):
    for parallel in (True, False):
        reply = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=300,
            temperature=0.8,
            seed=11,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        _check_calls(choice.message.tool_calls)
        if not parallel:
            assert len(choice.message.tool_calls) == 1
    live_bytes.idle_check()


def test_a_named_function_is_the_one_called(client):
    reply = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "clock"}},
        max_tokens=100,
    )
    calls = reply.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["clock"]
    _check_calls(calls)


def test_streamed_tool_calls_add_up_to_the_plain_ones(client):
    kwargs = dict(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        max_tokens=300,
        temperature=0,
    )
    plain = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        reasons.append(chunk.choices[0].finish_reason)
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in plain
    ]


def test_a_tool_result_goes_back_through_the_template(client, live_bytes):
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=200
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    reply = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens
    none = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert none.choices[0].message.tool_calls is None
    live_bytes.idle_check()


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
    ],
)
def test_bad_tool_requests_are_400s(live_bytes, extra, param):
    response = _post(live_bytes, "/v1/chat/completions", {"messages": ASK, **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_malformed_arguments_in_history_are_a_400(live_bytes):
    history = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{x"}}
            ],
        },
    ]
    response = _post(live_bytes, "/v1/chat/completions", {"messages": history})
    assert response.status_code == 400 and "arguments" in response.json()["error"]["message"]
