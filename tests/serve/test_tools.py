"""Tool calling through the app and the official client. The tiny random model never writes a call, so replies are
forced: `engine.generate` is replaced by one that streams a fixed text (conftest's `forced`; the prompt it got is
recorded)."""

from __future__ import annotations

import json

import openai
import pytest

from lmd.chat_templates import get_chat_template
from lmd.errors import LmdError
from tests.serve.conftest import MODEL, sse_payloads

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
REPLY = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module", autouse=True)
def qwen_template(engine):
    """The tiny workspace uses SmolLM2's own template, which has no tools; serve it as the qwen (ChatML) family."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "chat_template", get_chat_template("qwen"))
        yield


def test_tools_are_rendered_into_the_prompt(client, engine, monkeypatch):
    seen = []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda ids, *a, **k: seen.append(engine.tokenizer.decode(ids))
                        or generate(ids, *a, **k))
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, "tools": TOOLS}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert client.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200
    with_tools, without = seen
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in with_tools and "<tool_call>" in with_tools
    assert "<tools>" not in without and "get_weather" not in without


def test_a_call_comes_back_as_tool_calls(openai_client, forced):
    forced(REPLY)
    reply = openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_call_first_names_then_sends_arguments(openai_client, forced):
    forced(REPLY)
    content, calls, finish = "", [], None
    for chunk in openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    head, *rest = calls
    assert content == "Let me check." and finish == "tool_calls"
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert all(c.id is None and c.function.name is None for c in rest)
    assert json.loads("".join(c.function.arguments for c in rest)) == {"city": "Paris"}


def test_the_tool_result_continues_the_conversation(openai_client, forced):
    forced(REPLY)
    first = openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS).choices[0].message
    prompts = forced("It is 18 C in Paris.")
    follow = ASK + [first.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 C"}]
    answer = openai_client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS).choices[0]
    assert answer.message.content == "It is 18 C in Paris." and answer.finish_reason == "stop"
    assert not answer.message.tool_calls
    assert ('<|im_start|>assistant\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>'
            in prompts[-1])


def test_parallel_tool_calls_false_keeps_the_first_call(client, forced):
    forced(REPLY + REPLY.replace("Let me check.", ""))
    body = {"messages": ASK, "tools": TOOLS}
    assert len(client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]) == 2
    one = client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False}).json()
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1


def test_malformed_call_is_content_streamed_or_not(client, forced):
    text = '<tool_call>{"name": "get_weather", "arguments": {oops}}</tool_call>'
    forced(text)
    body = {"messages": ASK, "tools": TOOLS}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["message"] == {"role": "assistant", "content": text} and whole["finish_reason"] == "stop"
    chunks = [json.loads(p) for p in sse_payloads(client.post("/v1/chat/completions",
                                                              json={**body, "stream": True}).text)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text


def test_parser_flag_overrides_the_family(engine, forced):
    from fastapi.testclient import TestClient

    from lmd.serve.app import create_app

    forced('{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    with TestClient(create_app(engine, MODEL, tool_call_parser="llama3_json")) as llama:
        message = llama.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS}).json()["choices"][0]
    assert json.loads(message["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    with pytest.raises(LmdError, match="tool call parser 'bogus' is unknown"):
        create_app(engine, MODEL, tool_call_parser="bogus")


@pytest.mark.parametrize(("changes", "param", "words"), [
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "only one"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}]}, "tools.0.function.parameters", "nonsense"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "letters"),
    ({"tools": TOOLS * 2}, "tools.1.function.name", "twice"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     "messages.1.tool_calls.0.function.arguments", "not JSON"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls", "assistant"),
])
def test_bad_tool_requests_are_400s(client, changes, param, words):
    response = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, "tools": TOOLS, **changes})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_the_client_sees_a_tool_choice_refusal(openai_client):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                              tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_template_without_tools_refuses_them(client, engine, monkeypatch):
    monkeypatch.setattr(engine, "chat_template", get_chat_template("hf"))  # SmolLM2's own: no tools
    body = {"messages": ASK, "max_tokens": 2, "tools": TOOLS}
    error = client.post("/v1/chat/completions", json=body).json()["error"]
    assert error["param"] == "tools" and "no format for tools" in error["message"]
    assert client.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200


def test_mistral_calls_keep_their_special_token(engine):
    from lmd.serve.protocol import ChatCompletionRequest
    from lmd.serve.tools import tool_use
    from lmd.turbomind.gen_config import GenerationConfig

    body = ChatCompletionRequest(messages=ASK, tools=TOOLS)
    use = tool_use(body, get_chat_template("mistral"), engine.tokenizer, None)
    assert use.configure(GenerationConfig(), body).skip_special_tokens is False
    explicit = ChatCompletionRequest(messages=ASK, tools=TOOLS, skip_special_tokens=True)
    with pytest.raises(Exception, match="TOOL_CALLS"):
        use.configure(GenerationConfig(), explicit)


def test_openapi_describes_the_tool_fields(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    request = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(request)
    assert {"tool_calls", "tool_call_id"} <= set(schemas["ChatMessage"]["properties"])
    assert {"name", "description", "parameters"} <= set(schemas["FunctionDefinition"]["properties"])
    assert "NamedToolChoice" in schemas
