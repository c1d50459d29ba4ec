"""n and best_of through the official openai client: n choices from one prefill (the engine's counters say so),
indexed prompt by prompt; best_of keeps the samples with the highest cumulative logprob; usage counts the prompt once."""

from __future__ import annotations

import json

from tests.serve.conftest import sse_payloads

PROMPT = [5, 900, 31, 7, 4000, 12, 77, 300, 21, 8, 19000, 3, 64]


def test_n_choices_come_from_one_prefill(openai_client, engine):
    before = engine.stats().computed_tokens
    reply = openai_client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=6, temperature=1.0,
                                             seed=4, extra_body={"ignore_eos": True, "top_k": 0})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) == 3  # three different samples
    assert engine.stats().computed_tokens - before == len(PROMPT) + 3 * 5  # one prefill, then 5 fed back each
    assert reply.usage.prompt_tokens == len(PROMPT) and reply.usage.completion_tokens == 18


def test_n_with_batched_prompts_and_chat(openai_client):
    reply = openai_client.completions.create(model="tiny", prompt=[PROMPT, PROMPT[:7]], n=2, max_tokens=3,
                                             temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.choices[0].text == reply.choices[1].text  # greedy: every sample is the same
    chat = openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                                 max_tokens=4, temperature=0.9, seed=1)
    assert [c.index for c in chat.choices] == [0, 1]


def test_best_of_keeps_the_best_cumulative_logprob(openai_client):
    common = dict(model="tiny", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=9, logprobs=0,
                  extra_body={"ignore_eos": True, "top_k": 0})
    every = openai_client.completions.create(n=4, **common)  # the same four samples (seed + i each)
    totals = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    best = openai_client.completions.create(n=2, best_of=4, **common)
    assert [c.text for c in best.choices] == sorted(totals, key=lambda t: -totals[t])[:2]
    assert best.usage.completion_tokens == 20  # every sample generated counts


def test_n_streamed(client):
    response = client.post("/v1/completions", json=dict(model="tiny", prompt=PROMPT, n=2, max_tokens=4,
                                                        temperature=0.8, seed=2, stream=True,
                                                        stream_options={"include_usage": True}))
    assert response.status_code == 200, response.text
    chunks = [json.loads(p) for p in sse_payloads(response.text) if p != "[DONE]"]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    whole = client.post("/v1/completions", json=dict(model="tiny", prompt=PROMPT, n=2, max_tokens=4,
                                                     temperature=0.8, seed=2)).json()
    assert [texts[0], texts[1]] == [c["text"] for c in whole["choices"]]
    assert chunks[-1]["usage"]["prompt_tokens"] == len(PROMPT)


def test_parallel_sampling_errors(client):
    def error(**body):
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", **body})
        assert response.status_code == 400, response.text
        return response.json()["error"]["param"]

    assert error(n=2, best_of=1) == "best_of"
    assert error(n=0) == "n"
    assert error(n=1, best_of=3, stream=True) == "best_of"
    assert error(n=500) == "n"
