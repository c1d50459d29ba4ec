"""/v1/completions: raw text or token-id prompts, no chat template, legacy logprobs."""

from __future__ import annotations

import json

from lmd.turbomind.gen_config import GenerationConfig
from tests.serve.conftest import MODEL, sse_payloads

GREEDY = {"model": MODEL, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
CONFIG = GenerationConfig(max_new_tokens=10, temperature=0, ignore_eos=True)


def _post(client, **body):
    response = client.post("/v1/completions", json={**GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_text_prompt_is_not_templated_and_equals_engine_generate(client, engine):
    prompt = "The capital of France is"
    ref = engine.generate(prompt, CONFIG, apply_chat_template=False).result()
    body = _post(client, prompt=prompt)
    [choice] = body["choices"]
    assert choice["text"] == ref.text and choice["token_ids"] == ref.token_ids and choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(engine.encode(prompt, apply_chat_template=False))
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert _post(client, prompt=[prompt])["choices"][0]["text"] == ref.text  # a one-prompt batch


def test_token_id_prompt_and_stream(client, engine):
    ids = [5, 900, 31, 7, 4000, 12]
    ref = engine.generate(ids, CONFIG).result()
    assert _post(client, prompt=ids)["choices"][0]["token_ids"] == ref.token_ids
    assert _post(client, prompt=[ids])["choices"][0]["token_ids"] == ref.token_ids
    response = client.post(
        "/v1/completions", json={**GREEDY, "prompt": ids, "stream": True, "stream_options": {"include_usage": True}}
    )
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == ref.text
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    # the same prompt ran before: its one full 4-token block comes from the prefix cache
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 10,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_legacy_logprobs(client, engine):
    prompt = "Once upon a time"
    ref = engine.generate(
        prompt, GenerationConfig(max_new_tokens=5, temperature=0, ignore_eos=True, logprobs=2), apply_chat_template=False
    ).result()
    logprobs = _post(client, prompt=prompt, max_tokens=5, logprobs=2)["choices"][0]["logprobs"]
    tokens = [engine.tokenizer.decode([t]) for t in ref.token_ids]
    assert logprobs["tokens"] == tokens
    assert all(abs(a - b) < 1e-5 for a, b in zip(logprobs["token_logprobs"], ref.logprobs, strict=True))
    assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])  # two ids may decode to one string
    assert all(
        max(top.values()) == lp for top, lp in zip(logprobs["top_logprobs"], logprobs["token_logprobs"], strict=True)
    )
    offsets = [0]
    for token in tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets


def test_completion_errors_name_the_field(client):
    def error(**body):
        response = client.post("/v1/completions", json={**GREEDY, **body})
        assert response.status_code == 400, response.text
        return response.json()["error"]

    assert error(prompt=[])["param"] == "prompt"
    assert error(prompt=[[1, 2], [3, 10**7]])["param"] == "prompt.1"
    assert error(prompt=["a", ""])["param"] == "prompt.1"
    bad = error(prompt=[1, 2, 10**7])
    assert bad["param"] == "prompt" and "10000000" in bad["message"]
    assert error(prompt="x", logprobs=999)["param"] == "logprobs"
    assert error(prompt=list(range(1, 300)))["param"] == "prompt"  # longer than the engine holds


def test_openai_penalties_and_logit_bias_reach_the_sampler(client, engine):
    ids = [5, 900, 31, 7, 4000, 12]
    plain = _post(client, prompt=ids)["choices"][0]["token_ids"]
    forced = _post(client, prompt=ids, logit_bias={"777": 100})["choices"][0]["token_ids"]
    assert forced == [777] * 10
    # penalties and bias through the API give what the engine gives for the same GenerationConfig
    fresh = _post(client, prompt=ids, logit_bias={"777": 5}, frequency_penalty=2.0, presence_penalty=2.0)
    penalised = fresh["choices"][0]["token_ids"]
    ref = engine.generate(ids, GenerationConfig(max_new_tokens=10, temperature=0, ignore_eos=True,
                                                logit_bias={777: 5}, frequency_penalty=2.0,
                                                presence_penalty=2.0)).result()
    assert penalised == ref.token_ids and penalised != plain
