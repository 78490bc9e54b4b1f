"""Tool-call formats and parsers, without a server: whole text and any streamed split agree."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixserve.server.errors import APIError
from radixserve.server.tools import (
    HermesFormat,
    Llama3Format,
    check_tools,
    chosen_tools,
    tool_format,
)

TOOLS = check_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
)

HERMES_TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)


def test_hermes_output_parses_into_content_and_calls():
    content, calls = HermesFormat(True).parser(TOOLS, True).parse(HERMES_TEXT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    assert len({c.id for c in calls}) == 2


def test_without_parallel_calls_only_the_first_is_a_call():
    content, calls = HermesFormat(True).parser(TOOLS, False).parse(HERMES_TEXT)
    assert [c.name for c in calls] == ["get_weather"]
    assert "now" in content


def test_unknown_tools_and_bad_json_stay_text():
    text = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call> and <tool_call>{oops'
    content, calls = HermesFormat(True).parser(TOOLS, True).parse(text)
    assert calls == [] and content == text


def test_a_call_cut_off_at_the_end_still_parses_when_whole():
    text = '<tool_call>\n{"name": "now", "arguments": {}}'
    assert [c.name for c in HermesFormat(True).parser(TOOLS, True).parse(text)[1]] == ["now"]


@given(st.lists(st.integers(0, len(HERMES_TEXT)), max_size=12))
def test_streamed_hermes_equals_whole(cuts):
    points = sorted(set(cuts))
    pieces = [
        HERMES_TEXT[a:b] for a, b in zip([0, *points], [*points, len(HERMES_TEXT)], strict=False)
    ]
    parser = HermesFormat(True).parser(TOOLS, True)
    content, calls = "", []
    for piece in pieces:
        c, k = parser.feed(piece)
        content, calls = content + c, calls + k
    c, k = parser.finish()
    content, calls = content + c, calls + k
    whole_content, whole_calls = HermesFormat(True).parser(TOOLS, True).parse(HERMES_TEXT)
    assert content.strip() == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_llama3_json_calls_parse_and_plain_text_streams_through():
    fmt = Llama3Format(True)
    text = (
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now", "parameters": {}}'
    )
    content, calls = fmt.parser(TOOLS, True).parse(text)
    assert content is None and [c.name for c in calls] == ["get_weather", "now"]
    parser = fmt.parser(TOOLS, True)
    assert parser.feed("Hello") == ("Hello", [])
    assert parser.feed(" there") == (" there", [])
    assert parser.finish() == ("", [])


def test_the_format_follows_the_chat_template():
    assert isinstance(tool_format(None), HermesFormat)
    assert not tool_format("{{ messages }}").template_knows_tools
    assert tool_format("{% if tools %}<tool_call>{% endif %}").template_knows_tools
    llama = "{% if tools %}Environment: ipython{% endif %}<|python_tag|>"
    assert isinstance(tool_format(llama), Llama3Format)


def test_the_forcing_grammar_names_each_tool():
    tag = json.loads(HermesFormat(True).grammar(TOOLS, "required", parallel=False))
    fmt = tag["format"]
    assert fmt["type"] == "tags_with_separator" and fmt["stop_after_first"]
    assert next(t["begin"] for t in fmt["tags"]).endswith('"get_weather", "arguments": ')
    forced = json.loads(Llama3Format(True).grammar(TOOLS[:1], "forced", parallel=True))
    assert forced["format"]["type"] == "tag"


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        ([{"type": "function"}], None, "tools[0]"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "must match"),
        (
            [{"type": "function", "function": {"name": "a"}}] * 2,
            None,
            "defined twice",
        ),
        (
            [{"type": "function", "function": {"name": "a", "parameters": [1]}}],
            None,
            "JSON schema",
        ),
        ([], "required", "only allowed when tools"),
        ([{"type": "function", "function": {"name": "a"}}], {"type": "function"}, "must be"),
        (
            [{"type": "function", "function": {"name": "a"}}],
            {"type": "function", "function": {"name": "b"}},
            "not in tools",
        ),
    ],
)
def test_bad_tools_are_400s(tools, choice, message):
    with pytest.raises(APIError) as err:
        chosen_tools(check_tools(tools), choice)
    assert err.value.status == 400 and message in err.value.message
