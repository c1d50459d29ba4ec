"""/tokenize and /detokenize (vLLM's): the ids the generation endpoints would use, and back to text."""

from __future__ import annotations

import pytest

from tests.serve.conftest import MODEL


def _post(client, path: str, **body):
    return client.post(path, json={"model": MODEL, **body})


def test_tokenize_a_prompt_and_messages_as_generation_encodes_them(client, engine):
    text = "The capital of France is"
    body = _post(client, "/tokenize", prompt=text).json()
    ids = engine.encode(text, apply_chat_template=False)
    assert body == {"count": len(ids), "max_model_len": engine.max_len, "tokens": ids}
    plain = _post(client, "/tokenize", prompt=text, add_special_tokens=False).json()["tokens"]
    assert plain == list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = _post(client, "/tokenize", messages=messages).json()
    assert chat["tokens"] == engine.encode(messages) and chat["count"] == len(chat["tokens"])
    varied = _post(client, "/tokenize", messages=messages, chat_template_kwargs={"unused_variable": 1}).json()
    assert varied["tokens"] == chat["tokens"]  # variables reach the template (this one reads none)
    refused = _post(client, "/tokenize", messages=messages, chat_template_kwargs={"tools": []})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"
    # the same count the completion's usage reports
    usage = _post(client, "/v1/completions", prompt=text, max_tokens=1, temperature=0).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]


def test_detokenize_round_trips(client):
    text = "Paris is the capital of France."
    ids = _post(client, "/tokenize", prompt=text, add_special_tokens=False).json()["tokens"]
    assert _post(client, "/detokenize", tokens=ids).json() == {"prompt": text}


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/tokenize", {}, "prompt", "exactly one of prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt", "exactly one"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "y"}]}, "messages.0.role", "robot"),
    ("/detokenize", {"tokens": [5, 10**7]}, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, "tokens", ""),
])
def test_bad_requests_are_400s_naming_the_field(client, path, body, param, words):
    response = _post(client, path, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_another_model_name_is_a_404(client):
    assert client.post("/tokenize", json={"model": "gpt-5", "prompt": "x"}).status_code == 404


def test_api_keys_guard_tokenize_too(engine):
    from fastapi.testclient import TestClient

    from lmd.serve.app import create_app

    with TestClient(create_app(engine, MODEL, ["sekrit"])) as guarded:
        assert guarded.post("/tokenize", json={"prompt": "x"}).status_code == 401
        ok = guarded.post("/detokenize", json={"tokens": [5]}, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
