"""Tool-call parsers on fixed model texts: whole replies and the same text fed one character at a time agree."""

from __future__ import annotations

import json
import re

import pytest

from lmd.serve.tool_parsers import TOOL_PARSERS, ToolCall, json_end

NAMES = frozenset({"get_weather", "add"})
PARIS = '{"city": "Paris"}'


def _parse(kind: str, text: str, step: int | None = None, max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    parser = TOOL_PARSERS[kind](NAMES, max_calls)
    pieces = []
    for i in range(0, len(text), step or max(len(text), 1)):
        pieces += parser.feed(text[i : i + (step or len(text))])
    pieces += parser.finish()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]


def _both(kind: str, text: str, **kwargs) -> tuple[str, list[tuple[str, dict]]]:
    """The whole reply's (content, calls); streamed one character at a time gives the same."""
    whole = _parse(kind, text, **kwargs)
    streamed = _parse(kind, text, step=1, **kwargs)
    as_data = [[(c.name, json.loads(c.arguments)) for c in calls] for _, calls in (whole, streamed)]
    assert (whole[0], as_data[0]) == (streamed[0], as_data[1])
    assert [c.index for c in whole[1]] == list(range(len(whole[1])))
    return whole[0], as_data[0]


HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CASES = {
    "hermes": (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    '{"name": "add", "parameters": {"a": 1, "b": 2}}'),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]'),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_one_call_alone_and_after_text(kind):
    call, _ = CASES[kind]
    assert _both(kind, call) == ("", [("get_weather", {"city": "Paris"})])
    weather = [("get_weather", {"city": "Paris"})]
    assert _both(kind, f"Let me look that up.\n\n{call}") == ("Let me look that up.", weather)


def test_several_calls():
    two = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert _both("hermes", "\n".join(CASES["hermes"])) == ("", two)
    assert _both("llama3_json", "; ".join(CASES["llama3_json"])) == ("", two)
    assert _both("llama3_json", "<|python_tag|>" + CASES["llama3_json"][0]) == ("", two[:1])
    mistral = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "add", "arguments": {"a": 1, "b": 2}}]')
    assert _both("mistral", mistral) == ("", two)
    assert _both("hermes", "\n".join(CASES["hermes"]), max_calls=1) == ("", two[:1])  # parallel_tool_calls=false


@pytest.mark.parametrize("text", [
    "No tools needed: it is sunny.",
    "a <tool_ca> b <tool_call> unclosed",
    '<tool_call>{"name": "get_weather", "arguments": {bad json}}</tool_call>',
    '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>',  # not offered
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
])
def test_hermes_text_that_is_not_a_call_is_content(text):
    assert _both("hermes", text) == (text, [])


def test_partial_opener_is_held_then_released():
    parser = TOOL_PARSERS["hermes"](NAMES)
    assert parser.feed("It is <tool") == ["It is"]
    assert parser.feed("box> now") == [" <toolbox> now"]
    assert parser.finish() == []


def test_hermes_without_closing_tag_at_the_end_is_a_call():
    assert _both("hermes", HERMES.removesuffix("</tool_call>")) == ("", [("get_weather", {"city": "Paris"})])


def test_llama3_plain_json_and_text_stay_content():
    text = 'The answer is {"x": 1}; that is all.'
    assert _both("llama3_json", text) == (text, [])
    assert _both("llama3_json", '{"name": "get_weather", "parameters": {"city": ') == (
        '{"name": "get_weather", "parameters": {"city": ', [])  # cut off by max_tokens


def test_mistral_malformed_is_content_and_text_between_calls_is_kept():
    assert _both("mistral", "hi [TOOL_CALLS] not json") == ("hi [TOOL_CALLS] not json", [])
    text = f"{HERMES}\nand then\n{HERMES}"
    assert _both("hermes", text) == ("and then", [("get_weather", {"city": "Paris"})] * 2)


def test_ids_and_arguments_text():
    _, [call] = _parse("hermes", HERMES)
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id) and call.arguments == PARIS
    assert _parse("hermes", HERMES)[1][0].id != call.id


def test_json_end():
    assert json_end('{"a": "}"} tail', 0) == 10
    assert json_end('[{"a": "\\""}]', 0) == 13
    assert json_end('{"a": [1, 2}', 0) is None
