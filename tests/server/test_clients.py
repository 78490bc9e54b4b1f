"""Real client libraries against a live server: langchain-openai's ChatOpenAI and litellm
(provider `openai/`), for chat, streaming, JSON-schema output and a tool call."""

from __future__ import annotations

import json
import os
from typing import Literal

import pytest
from conftest import LiveServer
from model_helpers import byte_checkpoint
from pydantic import BaseModel, Field

from radixserve.engine import Engine

pytest.importorskip("xgrammar", reason="structured output needs the xgrammar extra")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's pydantic models

ASK = "What is the weather in Paris for the next days?"


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=14)
    metric: bool


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for some days.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = byte_checkpoint(tmp_path_factory.mktemp("clients"))
    live = LiveServer(Engine(str(path), dtype="float32"))
    yield live
    live.stop()


# -- langchain-openai ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat(server):
    """ChatOpenAI on the server, by the number of tokens it may write."""
    pytest.importorskip("langchain_openai", reason="langchain-openai is in the test extra")
    from langchain_openai import ChatOpenAI

    def make(max_tokens: int):
        return ChatOpenAI(
            base_url=f"{server.url}/v1",
            api_key="unused",
            model="tiny",
            max_tokens=max_tokens,
            temperature=0,
            max_retries=0,
            timeout=60,
        )

    return make


def test_langchain_chat_and_stream_agree(chat, server):
    reply = chat(12).invoke(ASK)
    assert isinstance(reply.content, str) and reply.response_metadata["finish_reason"]
    pieces = [chunk.content for chunk in chat(12).stream(ASK)]
    assert len(pieces) > 1 and "".join(pieces) == reply.content
    server.idle_check()


def test_langchain_structured_output_validates(chat, server):
    structured = chat(160).with_structured_output(Forecast)
    for _ in range(3):
        forecast = structured.invoke(ASK)
        assert isinstance(forecast, Forecast)
    raw = chat(160).with_structured_output(Forecast.model_json_schema(), method="json_schema")
    out = raw.invoke(ASK)
    jsonschema.validate(out, Forecast.model_json_schema())
    server.idle_check()


def test_langchain_tool_call_arguments_parse(chat, server):
    bound = chat(200).bind_tools([WEATHER_TOOL], tool_choice="get_weather")
    message = bound.invoke(ASK)
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    assert call["args"]["city"] in ("Paris", "Oslo") and isinstance(call["args"]["days"], int)
    required = chat(200).bind_tools([WEATHER_TOOL], tool_choice="any")
    assert required.invoke(ASK).tool_calls[0]["name"] == "get_weather"
    server.idle_check()


# -- litellm ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    litellm = pytest.importorskip("litellm", reason="litellm is in the test extra")
    litellm.telemetry = False
    return litellm


def _litellm_args(server) -> dict:
    return {
        "model": "openai/tiny",
        "api_base": f"{server.url}/v1",
        "api_key": "unused",
        "messages": [{"role": "user", "content": ASK}],
        "temperature": 0,
        "timeout": 60,
    }


def test_litellm_chat_and_stream_agree(litellm, server):
    args = _litellm_args(server)
    reply = litellm.completion(max_tokens=12, **args)
    text = reply.choices[0].message.content
    assert isinstance(text, str) and reply.usage.completion_tokens > 0
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in litellm.completion(max_tokens=12, stream=True, **args)
    )
    assert streamed == text
    server.idle_check()


def test_litellm_json_schema_output_validates(litellm, server):
    schema = Forecast.model_json_schema()
    reply = litellm.completion(
        max_tokens=120,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "forecast", "schema": schema, "strict": True},
        },
        **_litellm_args(server),
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_litellm_tool_call_arguments_parse(litellm, server):
    reply = litellm.completion(
        max_tokens=200, tools=[WEATHER_TOOL], tool_choice="required", **_litellm_args(server)
    )
    [call, *_] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    assert reply.choices[0].finish_reason == "tool_calls"
    server.idle_check()
