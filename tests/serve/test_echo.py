"""echo + logprobs on /v1/completions (what lm-evaluation-harness's local-completions sends for log-likelihoods): the
prompt's tokens come back with their logprobs (the first null), equal to HF transformers' log-softmax, then the
completion's; batched, streamed and not."""

from __future__ import annotations

import json

import pytest
import torch

from tests.serve.conftest import sse_payloads


@pytest.fixture(scope="module")
def hf_model(tiny_llama_ws):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_ws[0], dtype=torch.float32)


def _hf_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


PROMPTS = [[5, 900, 31, 7, 4000, 12, 77, 300, 21, 8, 19000, 3, 64, 1200, 9, 45, 2, 610, 88, 5, 23, 7000, 4, 16, 3]
           , [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def test_echo_logprobs_equal_hf_log_softmax(openai_client, hf_model, engine):
    reply = openai_client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=1, temperature=0, echo=True,
                                             logprobs=1, extra_body={"return_token_ids": True})
    assert [c.index for c in reply.choices] == [0, 1]
    for prompt, choice in zip(PROMPTS, reply.choices, strict=True):
        lp = choice.logprobs
        n = len(prompt)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1  # prompt, then 1 token
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = _hf_logprobs(hf_model, prompt + choice.token_ids)
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], ref, strict=True)) <= 1e-4
        assert all(len(t) == 1 for t in lp.top_logprobs[1:])
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert choice.text.startswith(engine.tokenizer.decode(prompt))  # the prompt text, then the completion
    assert reply.usage.prompt_tokens == sum(len(p) for p in PROMPTS)


def test_echo_streamed_sends_the_prompt_first(client):
    body = dict(model="tiny", prompt="the quick brown fox", max_tokens=3, temperature=0, echo=True, logprobs=0,
                stream=True)
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    chunks = [json.loads(p) for p in sse_payloads(response.text) if p != "[DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith("the quick brown fox")
    assert first["logprobs"]["token_logprobs"][0] is None
    whole = client.post("/v1/completions", json={**body, "stream": False}).json()["choices"][0]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == whole["text"]
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert tokens == whole["logprobs"]["token_logprobs"]


def test_echo_without_logprobs_returns_the_prompt_text(client):
    reply = client.post("/v1/completions", json=dict(model="tiny", prompt="hello there", max_tokens=2,
                                                      temperature=0, echo=True)).json()["choices"][0]
    plain = client.post("/v1/completions", json=dict(model="tiny", prompt="hello there", max_tokens=2,
                                                      temperature=0)).json()["choices"][0]
    assert reply["text"] == "hello there" + plain["text"] and reply["logprobs"] is None
