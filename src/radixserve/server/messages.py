"""Chat messages as OpenAI clients send them, turned into what a chat template takes.

- `content` is a string, a list of text parts (concatenated), or null; an image, audio or file
  part is a 400 that names its type, since the served models read text only.
- `developer` is `system`; `name`, `tool_calls` and `tool_call_id` are kept.
- With tools: a template that knows tools gets them as `tools=`; one that does not gets them
  described in the system message, assistant calls written out as text, and tool results as
  user turns wrapped in `<tool_response>`.
"""

from __future__ import annotations

import json

from radixserve.server.errors import APIError
from radixserve.server.protocol import ChatMessage
from radixserve.server.tools import HermesFormat, Tool, ToolFormat


def message_text(message: ChatMessage, index: int) -> str:
    """The text of one message's content ("" for none)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise APIError(
                400,
                f"messages[{index}].content[{j}] is a {part.type!r} part; this model reads "
                "text only, so only 'text' parts are accepted",
                f"messages[{index}].content",
            )
        if part.text is None:
            raise APIError(400, f"messages[{index}].content[{j}] has no 'text'", "messages")
        pieces.append(part.text)
    return "".join(pieces)


def template_messages(
    messages: list[ChatMessage], fmt: ToolFormat, tools: list[Tool]
) -> tuple[list[dict], dict]:
    """(messages for the chat template, extra template arguments) for `tools` in `fmt`."""
    native = fmt.template_knows_tools
    out: list[dict] = []
    for i, m in enumerate(messages):
        text = message_text(m, i)
        role = "system" if m.role == "developer" else m.role
        item: dict = {"role": role, "content": text}
        if m.name is not None:
            item["name"] = m.name
        if m.tool_calls:
            calls = [(c.function.name, _arguments(c.function.arguments, i)) for c in m.tool_calls]
            if native:
                item["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": n, "arguments": a}}
                    for c, (n, a) in zip(m.tool_calls, calls, strict=True)
                ]
            else:
                written = "\n".join(fmt.render_call(n, a) for n, a in calls)
                item["content"] = f"{text}\n{written}" if text else written
        if role == "tool":
            if native:
                if m.tool_call_id is not None:
                    item["tool_call_id"] = m.tool_call_id
            else:
                item = {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
        out.append(item)
    if not tools:
        return out, {}
    if native:
        return out, {"tools": [t.as_openai() for t in tools]}
    assert isinstance(fmt, HermesFormat)  # tool_format's fallback for such templates
    prompt = fmt.system_prompt(tools)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _arguments(text: str, index: int) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise APIError(
            400,
            f"messages[{index}].tool_calls: function.arguments must be a JSON object as text",
            "messages",
        )
    return value
