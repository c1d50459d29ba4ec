"""Model text -> OpenAI tool calls, incrementally, for the three call formats of the template families lmd knows.

    llama3_json  {"name": "f", "parameters": {...}}            (Llama 3.1; calls may be separated by ';')
    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (Hermes, Qwen2/2.5 ChatML)
    mistral      [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]       (Mistral v0.3)

One parser serves streaming and whole replies alike (a whole reply is fed in one piece), so a stream adds up to the
non-streamed answer exactly. Invariants:
- A call is held until its JSON is complete, then released as one piece: a malformed call (bad JSON, no name, a
  function that was not offered, arguments that are not an object) is returned as plain content, streamed or not.
- Text that may be the start of an opener (a partial `<tool_call>`) is held until it cannot be.
- Separators next to a call (whitespace, and ';' / ',' in the formats that use them) are dropped; trailing ones are
  held until it is known whether a call or more content follows (kept when the reply has no call).
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)


Piece = str | ToolCall  # content text, or a complete call


def new_call_id() -> str:
    """OpenAI's shape: call_ and 24 letters or digits (their last 9 are a valid Mistral id)."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def json_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array opening at text[start], or None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class ToolCallParser:
    """Base: finds call regions (`opener` ... `_region_end`) in the text and turns each into calls (`_calls_of`)."""

    openers: tuple[str, ...] = ()
    separators = " \t\r\n"
    arguments_keys: tuple[str, ...] = ("arguments", "parameters")
    needs_special_tokens = False  # True: the opener is a special token, the reply must be detokenized with it
    # How a forced call is written (tool_choice required / named; tools.tool_call_output builds the grammar):
    # call_begin + {"name": ..., arguments_key: {...}} + call_end, calls joined by call_separator; or, with
    # calls_in_array, call_begin + [call, call, ...].
    call_begin = ""
    call_end = ""
    call_separator = "\n"
    arguments_key = "arguments"
    calls_in_array = False

    def __init__(self, tool_names: frozenset[str], max_calls: int | None = None) -> None:
        self.tool_names, self.max_calls = tool_names, max_calls
        self.calls_found = 0
        self._buffer = ""  # text not yet released
        self._in_call = False  # _buffer starts with an opener
        self._held = ""  # separators awaiting the next content or call
        self._after_call = False  # separators here follow a call: dropped

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while self._buffer:
            if self._in_call:
                end = self._region_end(self._buffer)
                if end is None:
                    break
                region, self._buffer, self._in_call = self._buffer[:end], self._buffer[end:], False
                self._release_region(region, out)
                continue
            at = self._find_opener(self._buffer)
            if at is None:
                keep = self._partial_opener_len(self._buffer)
                self._content(self._buffer[: len(self._buffer) - keep], out)
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            self._content(self._buffer[:at], out)
            self._buffer, self._in_call = self._buffer[at:], True
        return out

    def finish(self) -> list[Piece]:
        """The reply ended: an unterminated call is tried as it stands, else it is content."""
        out: list[Piece] = []
        if self._in_call:
            self._release_region(self._buffer, out, final=True)
        else:
            self._content(self._buffer, out)
        self._buffer, self._in_call = "", False
        if self._held and not self.calls_found:
            out.append(self._held)
        self._held = ""
        return out

    # ---- family hooks ----

    def _region_end(self, buffer: str) -> int | None:
        raise NotImplementedError

    def _payload(self, region: str, final: bool) -> Any:
        """The JSON value inside a region (a call object or a list of them); raises ValueError if there is none."""
        raise NotImplementedError

    # ---- shared ----

    def _find_opener(self, text: str) -> int | None:
        found = [i for i in (text.find(o) for o in self.openers) if i >= 0]
        return min(found) if found else None

    def _partial_opener_len(self, text: str) -> int:
        longest = 0
        for opener in self.openers:
            for n in range(min(len(opener) - 1, len(text)), longest, -1):
                if opener.startswith(text[-n:]):
                    longest = n
                    break
        return longest

    def _content(self, text: str, out: list[Piece]) -> None:
        if self._after_call:
            text = text.lstrip(self.separators)
        if not text:
            return
        self._after_call = False
        stripped = text.rstrip(self.separators)
        if not stripped.strip(self.separators):  # separators only: hold them
            self._held += text
            return
        out.append(self._held + stripped)
        self._held = text[len(stripped) :]

    def _release_region(self, region: str, out: list[Piece], final: bool = False) -> None:
        calls = self._calls_in(region, final)
        if calls is None:
            self._content(region, out)
            return
        self._held, self._after_call = "", True
        for name, arguments in calls:
            if self.max_calls is None or self.calls_found < self.max_calls:
                out.append(ToolCall(self.calls_found, new_call_id(), name, json.dumps(arguments, ensure_ascii=False)))
                self.calls_found += 1

    def _calls_in(self, region: str, final: bool) -> list[tuple[str, dict[str, Any]]] | None:
        try:
            payload = self._payload(region, final)
        except ValueError:
            return None
        items = payload if isinstance(payload, list) else [payload]
        calls = []
        for item in items:
            if not isinstance(item, dict) or item.get("name") not in self.tool_names:
                return None
            arguments = next((item[k] for k in self.arguments_keys if k in item), {})
            if not isinstance(arguments, dict):
                return None
            calls.append((item["name"], arguments))
        return calls or None


def _json_after(buffer: str, offset: int) -> int | None:
    """End of the JSON value after `offset` (whitespace skipped); `offset` itself when no JSON value starts there."""
    start = offset
    while start < len(buffer) and buffer[start].isspace():
        start += 1
    if start == len(buffer):
        return None
    if buffer[start] not in "{[":
        return offset
    return json_end(buffer, start)


class Llama3JsonParser(ToolCallParser):
    openers = ("<|python_tag|>", "{")
    separators = " \t\r\n;"
    call_separator = "; "
    arguments_key = "parameters"

    def _region_end(self, buffer: str) -> int | None:
        tag = self.openers[0]
        return _json_after(buffer, len(tag)) if buffer.startswith(tag) else json_end(buffer, 0)

    def _payload(self, region: str, final: bool) -> Any:
        return json.loads(region.removeprefix(self.openers[0]))


class HermesParser(ToolCallParser):
    openers = ("<tool_call>",)
    closer = "</tool_call>"
    call_begin = "<tool_call>\n"
    call_end = "\n</tool_call>"

    def _region_end(self, buffer: str) -> int | None:
        at = buffer.find(self.closer)
        return None if at < 0 else at + len(self.closer)

    def _payload(self, region: str, final: bool) -> Any:
        inner = region[len(self.openers[0]) :]
        if inner.endswith(self.closer):
            inner = inner[: -len(self.closer)]
        elif not final:
            raise ValueError("unterminated")
        payload = json.loads(inner)
        if isinstance(payload, list):
            raise ValueError("one call per tag")
        return payload


class MistralParser(ToolCallParser):
    openers = ("[TOOL_CALLS]",)
    separators = " \t\r\n,"
    needs_special_tokens = True
    # Forced, the opener is written as text: the grammar's tokenizer view never allows a special token. The text
    # detokenizes to the same "[TOOL_CALLS]" the parser looks for.
    call_begin = "[TOOL_CALLS] "
    calls_in_array = True

    def _region_end(self, buffer: str) -> int | None:
        return _json_after(buffer, len(self.openers[0]))

    def _payload(self, region: str, final: bool) -> Any:
        return json.loads(region[len(self.openers[0]) :])


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "llama3_json": Llama3JsonParser,
    "hermes": HermesParser,
    "mistral": MistralParser,
}
