"""Tool calls: how a model family writes them, the grammar that forces one, and the parsers.

Two families are known:

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, as Qwen2.5,
  Qwen3 and Hermes write them. It is also the fallback for a chat template that knows nothing
  of tools (SmolLM2's, for one): the tools are then described in the system message.
- `llama3`: a bare `{"name": ..., "parameters": {...}}` object, as Llama 3.1-3.3 write them.

`ToolFormat.grammar` builds an xgrammar structural tag (JSON text) that makes the output one or
more well-formed calls whose arguments follow each tool's schema: used for `tool_choice`
`required` or a named function. `ToolCallParser` turns output text, whole or streamed, back
into content and calls. Nothing here imports torch or xgrammar.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from radixserve.server.errors import APIError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict

    def as_openai(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def check_tools(tools: list[dict]) -> list[Tool]:
    """The request's `tools`, checked; a bad one is a 400 naming it."""
    out, seen = [], set()
    for i, raw in enumerate(tools):
        function = raw.get("function") if isinstance(raw, dict) else None
        if not isinstance(raw, dict) or raw.get("type") != "function" or not function:
            raise APIError(
                400, f"tools[{i}] must be {{'type': 'function', 'function': ...}}", "tools"
            )
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(
                400, f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}", "tools"
            )
        if name in seen:
            raise APIError(400, f"tools[{i}]: the function {name!r} is defined twice", "tools")
        seen.add(name)
        params = function.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else params
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema", "tools")
        out.append(Tool(name, function.get("description"), params))
    return out


def chosen_tools(tools: list[Tool], tool_choice) -> tuple[list[Tool], str]:
    """(the tools the model may call, mode) with mode `none`, `auto`, `required` or `forced`."""
    if tool_choice is None:
        return (tools, "auto") if tools else ([], "none")
    if not tools:
        raise APIError(400, "tool_choice is only allowed when tools are given", "tool_choice")
    if tool_choice in ("none", "auto", "required"):
        return tools, tool_choice
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
    if not isinstance(name, str):
        raise APIError(
            400,
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    match = [t for t in tools if t.name == name]
    if not match:
        raise APIError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return match, "forced"


class ToolFormat:
    """How one model family writes a call; `family` names it."""

    family = ""

    def __init__(self, template_knows_tools: bool) -> None:
        self.template_knows_tools = template_knows_tools

    def _begin(self, name: str) -> str:
        raise NotImplementedError

    _end = ""
    _separator = "\n"

    def render_call(self, name: str, arguments: dict) -> str:
        return self._begin(name) + json.dumps(arguments, ensure_ascii=False) + self._end

    def grammar(self, tools: list[Tool], mode: str, parallel: bool) -> str:
        """An xgrammar structural tag (JSON) forcing calls of `tools`: one when `mode` is
        `forced` or `parallel` is off, else one or more."""
        tags = [
            {
                "type": "tag",
                "begin": self._begin(t.name),
                "content": {
                    "type": "json_schema",
                    "json_schema": t.parameters,
                    "max_whitespace_cnt": 1,  # else a weak model can pad with blanks forever
                },
                "end": self._end,
            }
            for t in tools
        ]
        if mode == "forced":
            fmt = tags[0]
        else:
            fmt = {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": self._separator,
                "at_least_one": True,
                "stop_after_first": not parallel,
            }
        return json.dumps({"type": "structural_tag", "format": fmt})

    def parser(self, tools: list[Tool], parallel: bool) -> ToolCallParser:
        raise NotImplementedError


class HermesFormat(ToolFormat):
    family = "hermes"
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"
    _end = "}\n</tool_call>"

    def _begin(self, name: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": '

    def render_call(self, name: str, arguments: dict) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self._OPEN}\n{body}\n{self._CLOSE}"

    def system_prompt(self, tools: list[Tool]) -> str:
        """Describes `tools` for a model whose chat template cannot."""
        lines = [
            "You may call the functions below. Each is given as a JSON schema:",
            *(json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in tools),
            "To call one, answer with nothing but",
            f'{self._OPEN}\n{{"name": "<function name>", "arguments": {{<its arguments>}}}}\n'
            f"{self._CLOSE}",
            "and wait for its result. Otherwise answer in plain text.",
        ]
        return "\n".join(lines)

    def parser(self, tools: list[Tool], parallel: bool) -> ToolCallParser:
        return _TaggedParser(self._OPEN, self._CLOSE, tools, parallel)


class Llama3Format(ToolFormat):
    family = "llama3"
    _end = "}"
    _separator = "; "

    def _begin(self, name: str) -> str:
        return f'{{"name": "{name}", "parameters": '

    def parser(self, tools: list[Tool], parallel: bool) -> ToolCallParser:
        return _BareJSONParser(tools, parallel)


def tool_format(chat_template: str | None) -> ToolFormat:
    """The tool-call format of the model whose chat template is `chat_template`."""
    template = chat_template or ""
    if "tools" not in template:
        return HermesFormat(False)  # tools go in the system message, calls in hermes form
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return Llama3Format(True)
    return HermesFormat(True)


# -- parsing -------------------------------------------------------------------------------


class ToolCallParser:
    """Splits output text into content and tool calls, whole (`parse`) or streamed (`feed`).

    `feed(piece)` returns (content delta, new calls) as soon as they are certain; `finish()`
    returns what is left. A call whose JSON does not parse, or that names an unknown tool,
    stays in the content as text.
    """

    def __init__(self, tools: list[Tool], parallel: bool) -> None:
        self.names = {t.name for t in tools}
        self.parallel = parallel
        self.calls: list[ToolCall] = []

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = self.feed(text)
        more, last = self.finish()
        content = (content + more).strip()
        return (content or None), calls + last

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def _call(self, obj, args_key: str) -> ToolCall | None:
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        arguments = obj.get(args_key, obj.get("arguments", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        if self.calls and not self.parallel:
            return None
        call = ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))
        self.calls.append(call)
        return call


class _TaggedParser(ToolCallParser):
    def __init__(self, open_tag: str, close_tag: str, tools: list[Tool], parallel: bool) -> None:
        super().__init__(tools, parallel)
        self.open, self.close = open_tag, close_tag
        self.buffer = ""
        self.inside = False

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        self.buffer += piece
        content, calls = "", []
        while True:
            if not self.inside:
                at = self.buffer.find(self.open)
                if at < 0:
                    keep = _partial_suffix(self.buffer, self.open)
                    content += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return content, calls
                content += self.buffer[:at]
                self.buffer = self.buffer[at + len(self.open) :]
                self.inside = True
            at = self.buffer.find(self.close)
            if at < 0:
                return content, calls
            body, self.buffer = self.buffer[:at], self.buffer[at + len(self.close) :]
            self.inside = False
            call = self._parse_body(body)
            if call is None:
                content += self.open + body + self.close
            else:
                calls.append(call)

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        if not self.inside:
            return rest, []
        self.inside = False
        call = self._parse_body(rest)  # a call cut off by the end of the output
        return ("", [call]) if call is not None else (self.open + rest, [])

    def _parse_body(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        return self._call(obj, "arguments")


class _BareJSONParser(ToolCallParser):
    """Calls are JSON objects making up the whole output (after `<|python_tag|>`), separated
    by `;` or whitespace. Output that does not start with `{` is content, streamed as is."""

    def __init__(self, tools: list[Tool], parallel: bool) -> None:
        super().__init__(tools, parallel)
        self.buffer = ""
        self.mode: str | None = None  # "content" or "calls", once known

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        self.buffer += piece
        if self.mode is None:
            head = self.buffer.lstrip().removeprefix("<|python_tag|>").lstrip()
            if not head:
                return "", []
            self.mode = "calls" if head.startswith("{") else "content"
        if self.mode == "content":
            out, self.buffer = self.buffer, ""
            return out, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self.buffer = self.buffer, ""
        if self.mode != "calls":
            return text, []
        body = text.strip().removeprefix("<|python_tag|>")
        decoder, at, calls = json.JSONDecoder(), 0, []
        while True:
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
            if at == len(body):
                break
            try:
                obj, at = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = self._call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
        return "", calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
