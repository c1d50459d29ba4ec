"""/v1/chat/completions against the engine it serves: same greedy tokens, streams that add up, usage, stops."""

from __future__ import annotations

import json

import pytest

from lmd.turbomind.gen_config import GenerationConfig
from tests.serve.conftest import MODEL, sse_payloads

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
GREEDY = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _post(client, **changes):
    response = client.post("/v1/chat/completions", json={**GREEDY, **changes})
    assert response.status_code == 200, response.text
    return response


@pytest.fixture(scope="module")
def reference(engine):
    """engine.generate's own greedy answer to MESSAGES."""
    return engine.generate(MESSAGES, GenerationConfig(max_new_tokens=12, temperature=0, ignore_eos=True)).result()


def test_greedy_text_tokens_and_usage_equal_engine_generate(client, engine, reference):
    body = _post(client, return_token_ids=True).json()
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": reference.text}
    assert choice["token_ids"] == reference.token_ids and len(reference.token_ids) == 12
    assert choice["finish_reason"] == "length"
    prompt_len = len(engine.encode(MESSAGES))
    assert body["usage"]["prompt_tokens"] == prompt_len
    assert body["usage"]["completion_tokens"] == 12 and body["usage"]["total_tokens"] == prompt_len + 12
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)


def test_stream_chunks_add_up_to_the_whole_answer(client, reference):
    response = _post(client, stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks[1:] if c["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in content) == reference.text
    assert [t for c in content for t in c["choices"][0]["token_ids"]] == reference.token_ids
    assert [c["choices"][0]["finish_reason"] for c in content][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    assert usage_chunk["usage"]["prompt_tokens"] == reference.usage.prompt_tokens
    assert all(c["usage"] is None for c in chunks[:-1])
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["object"] == "chat.completion.chunk"


def test_stream_without_include_usage_has_no_usage(client):
    payloads = sse_payloads(_post(client, stream=True).text)
    assert payloads[-1] == "[DONE]"
    assert all("usage" not in json.loads(p) for p in payloads[:-1])


def test_stop_string_is_excluded_and_finishes_with_stop(client, reference):
    text = reference.text
    stop = next(text[i : i + 3] for i in range(2, len(text) - 3) if text[i : i + 3].strip() == text[i : i + 3])
    expected = text[: text.index(stop)]
    body = _post(client, stop=[stop, "never-appears"]).json()
    assert body["choices"][0]["message"]["content"] == expected
    assert body["choices"][0]["finish_reason"] == "stop"
    chunks = [json.loads(p) for p in sse_payloads(_post(client, stop=stop, stream=True).text)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_max_completion_tokens_limits_the_answer(client, reference):
    body = _post(client, max_tokens=None, max_completion_tokens=5, return_token_ids=True).json()
    assert body["choices"][0]["token_ids"] == reference.token_ids[:5]
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"


def test_logprobs_match_the_engine(client, engine):
    config = GenerationConfig(max_new_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    ref = engine.generate(MESSAGES, config).result()
    content = _post(client, max_tokens=4, logprobs=True, top_logprobs=3).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    tokenizer = engine.tokenizer
    for entry, token, logprob, alternatives in zip(content, ref.token_ids, ref.logprobs, ref.top_logprobs, strict=True):
        assert entry["token"] == tokenizer.decode([token]) and entry["logprob"] == pytest.approx(logprob, abs=1e-5)
        assert entry["bytes"] == list(entry["token"].encode())
        assert [a["logprob"] for a in entry["top_logprobs"]] == pytest.approx([lp for _, lp in alternatives], abs=1e-5)
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy picks the most likely token


def test_seeded_sampling_repeats_and_content_parts_equal_a_string(client):
    sampled = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234, "max_tokens": 8}
    first = _post(client, **sampled).json()["choices"][0]["message"]["content"]
    parts = [
        {**MESSAGES[0]},
        {"role": "user", "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]},
    ]
    assert _post(client, messages=parts, **sampled).json()["choices"][0]["message"]["content"] == first


def test_stop_token_ids_and_min_tokens(client, reference):
    stop = reference.token_ids[2]
    first = reference.token_ids.index(stop)
    stopped = _post(client, stop_token_ids=[stop], return_token_ids=True).json()["choices"][0]
    assert stopped["token_ids"] == reference.token_ids[: first + 1] and stopped["finish_reason"] == "stop"
    held = _post(client, stop_token_ids=[stop], min_tokens=6, max_tokens=6, return_token_ids=True).json()["choices"][0]
    assert len(held["token_ids"]) == 6 and stop not in held["token_ids"] and held["finish_reason"] == "length"


def test_concurrent_requests_match_one_at_a_time(engine):
    import asyncio

    import httpx

    from lmd.serve.app import create_app

    app = create_app(engine, MODEL)
    bodies = [
        {**GREEDY, "messages": [{"role": "user", "content": f"Question number {i}?"}], "max_tokens": 6 + i}
        for i in range(4)
    ]

    async def ask_all(together: bool) -> list[str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as http:
            if together:
                responses = await asyncio.gather(*(http.post("/v1/chat/completions", json=b) for b in bodies))
            else:
                responses = [await http.post("/v1/chat/completions", json=b) for b in bodies]
        return [r.json()["choices"][0]["message"]["content"] for r in responses]

    alone = asyncio.run(ask_all(together=False))
    assert asyncio.run(ask_all(together=True)) == alone
    assert len(set(alone)) == 4
