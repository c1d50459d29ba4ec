"""/v1/completions with a list of prompts: a choice per prompt, indexed as OpenAI does, equal to single requests."""

from __future__ import annotations

import pytest

from tests.serve.conftest import MODEL

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
GREEDY = {"model": MODEL, "max_tokens": 6, "temperature": 0}
EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def singles(openai_client):
    return [openai_client.completions.create(prompt=p, **GREEDY, extra_body=EXTRA) for p in PROMPTS]


def test_choice_index_is_prompt_major(openai_client, singles):
    """n samples of each prompt, prompt after prompt (greedy: a prompt's samples are its single request's text)."""
    batch = openai_client.completions.create(prompt=PROMPTS, n=2, **GREEDY, extra_body=EXTRA)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles for _ in range(2)]


def test_list_of_strings_equals_single_requests(openai_client, singles):
    batch = openai_client.completions.create(prompt=PROMPTS, **GREEDY, extra_body=EXTRA)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert all(c.finish_reason == "length" for c in batch.choices)
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 18
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + 18


def test_token_id_lists_equal_string_prompts(openai_client, engine, singles):
    ids = [engine.encode(p, apply_chat_template=False) for p in PROMPTS]
    batch = openai_client.completions.create(prompt=ids, **GREEDY, extra_body=EXTRA)
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]


def test_streamed_batch_adds_up_per_index(openai_client, singles):
    texts = {i: "" for i in range(3)}
    finishes, usage = {}, None
    for chunk in openai_client.completions.create(prompt=PROMPTS, **GREEDY, stream=True,
                                                  stream_options={"include_usage": True}, extra_body=EXTRA):
        if not chunk.choices:
            usage = chunk.usage
            continue
        [choice] = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [s.choices[0].text for s in singles]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 18 and usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_batch_prompts_are_submitted_together(client, engine, monkeypatch):
    """Every prompt is queued in the engine before the first one's output is read."""
    events: list[str] = []
    generate = engine.generate

    class Read:
        """The engine's stream, noting when the app starts reading it."""

        def __init__(self, stream):
            self._stream = stream

        def __getattr__(self, name):
            return getattr(self._stream, name)

        def __aiter__(self):
            events.append("read")
            return self._stream.__aiter__()

    def recording(prompt, config=None, request_id=None, apply_chat_template=True):
        events.append(f"queue {len(prompt)}")
        return Read(generate(prompt, config, request_id=request_id, apply_chat_template=apply_chat_template))

    monkeypatch.setattr(engine, "generate", recording)
    body = client.post("/v1/completions", json={**GREEDY, "prompt": [[5, 6], [7, 8, 9]], "max_tokens": 2}).json()
    assert events == ["queue 2", "queue 3", "read", "read"] and len(body["choices"]) == 2


def test_logprobs_offsets_run_per_choice(client):
    body = client.post("/v1/completions", json={**GREEDY, **EXTRA, "prompt": PROMPTS[:2], "logprobs": 1}).json()
    for choice in body["choices"]:
        assert choice["logprobs"]["text_offset"][0] == 0 and len(choice["logprobs"]["tokens"]) == 6
