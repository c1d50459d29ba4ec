"""The OpenAI app over an engine in its own process (`EngineClient`, what `lmd serve` runs): the same replies as over
the in-process engine, streamed or not, several samples, structured output, refusals as 400, /metrics."""

from __future__ import annotations

import json

import pytest

from tests.serve.conftest import ENGINE_OPTIONS, MODEL, sse_payloads


@pytest.fixture(scope="module")
def process_client(serve_ws):
    from fastapi.testclient import TestClient

    from lmd.serve.app import create_app
    from lmd.turbomind.engine_core import EngineClient

    with EngineClient(serve_ws, **ENGINE_OPTIONS) as engine, TestClient(create_app(engine, MODEL)) as test_client:
        yield test_client


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True}


def test_replies_equal_the_in_process_engines(client, process_client):
    for body in (CHAT, {**CHAT, "n": 2, "temperature": 1.0, "seed": 4}, {**CHAT, "logprobs": True, "top_logprobs": 2}):
        ours = process_client.post("/v1/chat/completions", json=body).json()
        ref = client.post("/v1/chat/completions", json=body).json()
        assert ours["choices"] == ref["choices"] and ours["usage"] == ref["usage"]
    completion = {"model": MODEL, "prompt": ["Once upon", "a time"], "max_tokens": 5, "temperature": 0}
    ours = process_client.post("/v1/completions", json=completion).json()
    assert ours["choices"] == client.post("/v1/completions", json=completion).json()["choices"]


def test_streamed_reply_and_structured_output(process_client):
    whole = process_client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
    with process_client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        payloads = sse_payloads(response.read().decode())
    assert payloads[-1] == "[DONE]"
    assert "".join(json.loads(p)["choices"][0]["delta"].get("content", "") for p in payloads[:-1]) == whole
    body = {**CHAT, "max_tokens": 40, "ignore_eos": False, "response_format": {"type": "json_object"}}
    reply = process_client.post("/v1/chat/completions", json=body).json()["choices"][0]
    if reply["finish_reason"] == "stop":  # a random model may run out of tokens first; what it wrote must parse
        json.loads(reply["message"]["content"])
    else:
        assert reply["finish_reason"] == "length"


def test_refusals_and_metrics(process_client):
    long = {**CHAT, "messages": [{"role": "user", "content": "word " * 5000}]}
    response = process_client.post("/v1/chat/completions", json=long)
    assert response.status_code == 400 and "tokens" in response.json()["error"]["message"]
    bad = process_client.post("/v1/chat/completions", json={**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert bad.status_code == 400
    metrics = process_client.get("/metrics").text
    assert "lmd_kv_blocks_total" in metrics and "lmd_engine_steps_total" in metrics
