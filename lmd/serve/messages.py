"""OpenAI chat messages -> the chat template's messages (text parts joined, `developer` as system, tool calls with
their arguments parsed, since templates write them as JSON objects)."""

from __future__ import annotations

import json
from typing import Any

from lmd.serve.errors import bad_request
from lmd.serve.protocol import ChatMessage

ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise bad_request(f"messages.{i}.role", f"messages.{i}.role={message.role!r} is not supported; use "
                                                    "system, developer, user, assistant or tool")
        converted: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                     "content": _text_of(message, i)}
        if message.tool_calls:
            if message.role != "assistant":
                raise bad_request(f"messages.{i}.tool_calls", f"messages.{i}.tool_calls: only assistant messages "
                                                              "carry tool calls")
            converted["tool_calls"] = [_call_of(call, f"messages.{i}.tool_calls.{j}")
                                       for j, call in enumerate(message.tool_calls)]
        if message.role == "tool":
            if message.tool_call_id is None:
                raise bad_request(f"messages.{i}.tool_call_id", f"messages.{i}.tool_call_id is missing; send the id "
                                                                "of the tool call this message answers")
            converted["tool_call_id"] = message.tool_call_id
        out.append(converted)
    if not out:
        raise bad_request("messages", "messages is empty; send at least one message")
    return out


def _call_of(call: Any, field: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as exc:
        raise bad_request(f"{field}.function.arguments", f"{field}.function.arguments is not JSON ({exc}); send "
                                                         "the arguments object as a JSON string") from None
    if not isinstance(arguments, dict):
        raise bad_request(f"{field}.function.arguments", f"{field}.function.arguments must be a JSON object")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _text_of(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        if message.role != "assistant":
            raise bad_request(f"messages.{index}.content", f"messages.{index}.content is missing; send the text")
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages.{index}.content.{j}",
                f"messages.{index}.content.{j} has type {part.type!r}; only text parts are supported",
            )
        texts.append(part.text)
    return "".join(texts)
