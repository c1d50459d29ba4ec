"""`lmd serve --reasoning-parser` and `chat_template_kwargs`: the parser on its own (every split of the text gives the
whole reply's answer), then through the app with forced replies (conftest's `forced`)."""

from __future__ import annotations

import json

import pytest

from lmd.chat_templates import get_chat_template
from lmd.errors import LmdError
from lmd.serve.reasoning import Reasoning, ReasoningParser, starts_in_reasoning
from tests.serve.conftest import MODEL, sse_payloads

ASK = [{"role": "user", "content": "Capital of France?"}]
THINKING = "<think>\nThe user asks for a capital.\n</think>\n\nParis."
# a ChatML template that opens the reasoning in the prompt unless enable_thinking is false (Qwen3-Thinking's way)
OPEN_THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}"
)


def _split(text: str, size: int, inside: bool = False) -> tuple[str, str]:
    parser = ReasoningParser("qwen3", inside)
    pieces = [p for i in range(0, len(text), size) for p in parser.feed(text[i : i + size])] + parser.finish()
    return ("".join(p.text for p in pieces if isinstance(p, Reasoning)),
            "".join(p for p in pieces if isinstance(p, str)))


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), [
    (THINKING, False, "The user asks for a capital.", "Paris."),
    ("Paris.", False, "", "Paris."),  # no reasoning: the text is left exactly as written
    ("\n  Paris, of course.\n", False, "", "\n  Paris, of course.\n"),
    ("  <thi", False, "", "  <thi"),  # a start tag that never completed
    ("<think></think>Paris.", False, "", "Paris."),
    ("<think>\nstill thinking when max_tokens hit  \n", False, "still thinking when max_tokens hit", ""),
    ("Paris. <think>no</think>", False, "", "Paris. <think>no</think>"),  # a tag after the answer is content
    ("The user asks.\n</think>\n\nParis.", True, "The user asks.", "Paris."),  # the prompt opened the reasoning
    ("a < b </thin k> c</think>d", True, "a < b </thin k> c", "d"),
    ("<think>\nrepeated tag</think>X", True, "repeated tag", "X"),  # the prompt opened it, the reply opens it again
    ("  <thi", True, "<thi", ""),  # inside from the start: a tag that never completed is reasoning
])
def test_every_split_of_the_text_gives_the_whole_replys_answer(text, inside, reasoning, content):
    for size in (1, 2, 3, 7, len(text) + 1):
        assert _split(text, size, inside) == (reasoning, content), size


def test_the_reply_starts_inside_when_the_prompt_ends_in_an_open_tag():
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n", "deepseek_r1")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", "qwen3")
    assert not starts_in_reasoning("<|im_start|>assistant\n", "qwen3")


@pytest.fixture()
def thinking_client(engine):
    from fastapi.testclient import TestClient

    from lmd.serve.app import create_app

    with TestClient(create_app(engine, MODEL, reasoning_parser="qwen3")) as client:
        yield client


def _streamed(client, body: dict) -> tuple[str, str, list[dict]]:
    chunks = [json.loads(p) for p in sse_payloads(client.post("/v1/chat/completions",
                                                              json={**body, "stream": True}).text)[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    return ("".join(d.get("reasoning_content") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas),
            chunks)


def test_reasoning_content_whole_and_streamed(thinking_client, client, forced):
    forced(THINKING)
    message = thinking_client.post("/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris.", "reasoning_content": "The user asks for a capital."}
    reasoning, content, chunks = _streamed(thinking_client, {"messages": ASK})
    assert (reasoning, content) == ("The user asks for a capital.", "Paris.")
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "reasoning_content" not in chunks[0]["choices"][0]["delta"]  # the role chunk
    plain = client.post("/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": THINKING}  # without the parser nothing changes


def test_a_reply_without_reasoning_has_null_reasoning_content(thinking_client, forced):
    forced("Paris.")
    message = thinking_client.post("/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris.", "reasoning_content": None}


def test_the_official_client_reads_reasoning_content(thinking_client, forced):
    from openai import OpenAI

    forced(THINKING)
    api = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=thinking_client, max_retries=0)
    message = api.chat.completions.create(model=MODEL, messages=ASK).choices[0].message
    assert message.content == "Paris." and message.model_extra["reasoning_content"] == "The user asks for a capital."


def test_tool_calls_are_read_from_the_content_after_the_reasoning(engine, thinking_client, forced, monkeypatch):
    monkeypatch.setattr(engine, "chat_template", get_chat_template("qwen"))  # ChatML with Qwen2.5's tools
    tools = [{"type": "function", "function": {"name": "capital", "parameters": {"type": "object"}}}]
    call = '<tool_call>\n{"name": "capital", "arguments": {"country": "France"}}\n</tool_call>'
    forced("<think>I should call the tool.</think>\n" + call)
    body = {"messages": ASK, "tools": tools}
    choice = thinking_client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "I should call the tool."
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"country": "France"}
    reasoning, content, chunks = _streamed(thinking_client, body)
    assert (reasoning, content) == ("I should call the tool.", "")
    assert any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)


def test_enable_thinking_reaches_the_template_and_decides_where_the_reply_starts(engine, thinking_client, forced,
                                                                                  monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", OPEN_THINK_TEMPLATE)
    prompts = forced("The user asks.\n</think>\n\nParis.")
    message = thinking_client.post("/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]["message"]
    assert prompts[-1].endswith("<|im_start|>assistant\n<think>\n")
    assert (message["reasoning_content"], message["content"]) == ("The user asks.", "Paris.")
    forced("Paris.")
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    message = thinking_client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert prompts[-1].endswith("<|im_start|>assistant\n") and "<think>" not in prompts[-1]
    assert (message["reasoning_content"], message["content"]) == (None, "Paris.")


def test_a_grammar_starts_the_reply_outside_the_reasoning_the_prompt_opened(engine, thinking_client, forced,
                                                                           monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", OPEN_THINK_TEMPLATE)
    prompts = forced("Paris")
    body = {"messages": ASK, "guided_choice": ["Paris", "Rome"]}
    message = thinking_client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert prompts[-1].endswith("<think>\n")
    assert (message["reasoning_content"], message["content"]) == (None, "Paris")


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"tools": []}, "tools set how the template is applied"),
    ({"add_generation_prompt": False, "messages": []}, "add_generation_prompt, messages"),
])
def test_template_kwargs_that_are_arguments_are_400s(client, kwargs, words):
    reply = client.post("/v1/chat/completions", json={"messages": ASK, "chat_template_kwargs": kwargs})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "chat_template_kwargs" and words in error["message"]


def test_template_kwargs_need_the_tokenizers_template(client, engine, monkeypatch):
    monkeypatch.setattr(engine, "chat_template", get_chat_template("qwen"))
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400 and "MODEL_NAME hf" in reply.json()["error"]["message"]
    empty = {**body, "chat_template_kwargs": {}, "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=empty).status_code == 200


def test_an_unknown_reasoning_parser_is_refused(engine):
    from lmd.serve.app import create_app

    with pytest.raises(LmdError, match="reasoning parser 'o1' is unknown; use one of deepseek_r1, qwen3"):
        create_app(engine, MODEL, reasoning_parser="o1")
