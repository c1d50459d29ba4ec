"""Errors leave in OpenAI's shape with the right status and name the field to fix."""

from __future__ import annotations

import json

import pytest

from tests.serve.conftest import MODEL, sse_payloads

USER = [{"role": "user", "content": "hi"}]


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.fixture(scope="module")
def keyed(engine):
    from fastapi.testclient import TestClient

    from lmd.serve.app import create_app

    with TestClient(create_app(engine, MODEL, api_keys=["key-one", "key-two"])) as test_client:
        yield test_client


def test_api_keys(keyed):
    body = {"messages": USER, "max_tokens": 1}
    assert _error(keyed.post("/v1/chat/completions", json=body), 401)["code"] == "invalid_api_key"
    wrong = keyed.get("/v1/models", headers={"Authorization": "Bearer key-three"})
    assert _error(wrong, 401)["type"] == "invalid_request_error" and wrong.headers["www-authenticate"] == "Bearer"
    for key in ("key-one", "key-two"):
        ok = keyed.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    assert keyed.get("/health").status_code == 200  # probes need no key
    # a bad key is refused before the body is looked at
    assert _error(keyed.post("/v1/chat/completions", json={"n": 5}), 401)["code"] == "invalid_api_key"


def test_models_and_unknown_model(client, engine):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL] and data[0]["max_model_len"] == engine.max_len
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    error = _error(client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": USER}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-4" in error["message"]
    assert _error(client.get("/v1/models/gpt-4"), 404)["code"] == "model_not_found"
    assert _error(client.get("/v1/nothing-here"), 404)["param"] is None


@pytest.mark.parametrize(
    ("changes", "param", "words"),
    [
        ({"n": 0}, "n", "n=0"),
        ({"temperature": 3}, "temperature", "temperature=3"),
        ({"top_p": 0}, "top_p", "top_p=0"),
        ({"top_k": -5}, "top_k", "top_k=-5"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens=0"),
        ({"max_tokens": 10**6}, "max_tokens", "room for after its prompt"),
        ({"max_tokens": None, "max_completion_tokens": 10**6}, "max_completion_tokens", "room"),
        ({"max_tokens": None, "max_completion_tokens": -1}, "max_completion_tokens", "max_completion_tokens=-1"),
        ({"max_completion_tokens": 5}, "max_tokens", "disagree"),
        ({"max_tokens": 4, "min_tokens": 9}, "min_tokens", "min_tokens=9"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty=0"),
        ({"seed": -1}, "seed", "seed=-1"),
        ({"stop": 5}, "stop", "stop"),
        ({"stop": [""]}, "stop", "empty"),
        ({"logprobs": True, "top_logprobs": 100}, "top_logprobs", "top_logprobs=100"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs=true"),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty=2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty=-3"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "not a token id"),
        ({"logit_bias": {"5": 150}}, "logit_bias", "-100, 100"),
        ({"logit_bias": {"49152": 1}}, "logit_bias", "outside the vocabulary"),
        ({"min_p": 1.5}, "min_p", "min_p=1.5"),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "required"),
        ({"functions": [{"name": "f"}]}, "functions", "send tools"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
        ({"messages": []}, "messages", "empty"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "robot"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", "missing"),
        ({"messages": [{"role": "user"}]}, "messages.0.content", "missing"),
        ({"messages": [{"content": "x"}]}, "messages.0.role", "required"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0", "image_url"),
        ({"messages": [{"role": "user", "content": "word " * 300}]}, "messages", "tokens"),
    ],
)
def test_bad_parameters_are_400_naming_the_field(client, changes, param, words):
    error = _error(client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **changes}), 400)
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"


def test_body_that_is_not_json_or_not_an_object(client):
    raw = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert "JSON" in _error(raw, 400)["message"]
    assert _error(client.post("/v1/chat/completions", json=[1, 2]), 400)["message"]
    assert _error(client.post("/v1/chat/completions", json={"max_tokens": 1}), 400)["param"] == "messages"


def test_engine_failure_is_a_500_and_an_error_event(client, engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "run", broken)
    body = {"messages": USER, "max_tokens": 3}
    error = _error(client.post("/v1/chat/completions", json=body), 500)
    assert error["type"] == "server_error" and "device lost" in error["message"]
    payloads = sse_payloads(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert payloads[-1] == "[DONE]" and "device lost" in json.loads(payloads[-2])["error"]["message"]
    monkeypatch.undo()
    assert client.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] == 3
