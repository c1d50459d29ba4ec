"""Engine end to end on a tiny model: greedy output equals HF generate however requests are batched."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig

GREEDY = GenerationConfig(max_new_tokens=10, temperature=0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 3, 12)]


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama_ws) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_ws[0], dtype=torch.float32)
    out = []
    for p in _prompts():
        ids = model.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def _engine(ws, **overrides) -> Engine:
    options = dict(cache_block_seq_len=4, cache_max_entry_count=64, max_context_token_num=24)
    options.update(overrides)
    return Engine(ws, start=False, **options)


def _drain(engine: Engine, streams) -> list:
    while engine.step():
        pass
    return [s.result() for s in streams]


def test_one_at_a_time_and_all_together_match_hf(tiny_llama_ws, hf_greedy):
    engine = _engine(tiny_llama_ws[1])
    for prompt, ref in zip(_prompts(), hf_greedy, strict=True):
        [r] = _drain(engine, [engine.generate(prompt, GREEDY)])
        assert r.token_ids == ref and r.finish_reason == "length"
    results = _drain(engine, [engine.generate(p, GREEDY) for p in _prompts()])
    assert [r.token_ids for r in results] == hf_greedy
    stats = engine.stats()
    assert stats.blocks_used == 0 and stats.blocks_free == stats.blocks_total and stats.running == stats.waiting == 0


def test_staggered_arrivals_and_preemption_match_hf(tiny_llama_ws, hf_greedy):
    engine = _engine(tiny_llama_ws[1], cache_max_entry_count=14)  # 56 tokens of KV for 6 requests of up to 40
    streams = []
    for prompt in _prompts():
        streams.append(engine.generate(prompt, GREEDY))
        engine.step()
        engine.step()
    results = _drain(engine, streams)
    assert [r.token_ids for r in results] == hf_greedy
    stats = engine.stats()
    assert stats.preemptions > 0
    assert stats.blocks_used == 0 and stats.blocks_free == 14


def test_abort_frees_blocks_and_ends_the_stream(tiny_llama_ws):
    engine = _engine(tiny_llama_ws[1])
    long = engine.generate(_prompts()[3], GenerationConfig(max_new_tokens=200, temperature=0, ignore_eos=True),
                           request_id="a")
    short = engine.generate(_prompts()[0], GREEDY)
    for _ in range(4):
        engine.step()
    assert engine.stats().blocks_used > 0
    engine.abort("a")
    results = _drain(engine, [long, short])
    assert results[0].finish_reason == "abort" and 0 < len(results[0].token_ids) < 200
    assert results[1].finish_reason == "length"
    assert engine.stats().blocks_used == 0


def test_second_turn_prefills_only_new_tokens(tiny_llama_ws):
    engine = _engine(tiny_llama_ws[1])
    history = [{"role": "user", "content": "Tell me about the sea."}]
    first = _drain(engine, [engine.generate(history, GREEDY)])[0]
    prompt_tokens = first.usage.prompt_tokens
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And the sky?"}]
    before = engine.stats()
    second = _drain(engine, [engine.generate(history, GREEDY)])[0]
    after = engine.stats()
    hit = after.prefix_hit_tokens - before.prefix_hit_tokens
    assert second.usage.cached_tokens == hit >= (prompt_tokens // 4) * 4
    prefilled = after.computed_tokens - before.computed_tokens - (GREEDY.max_new_tokens - 1)
    assert prefilled == second.usage.prompt_tokens - hit < second.usage.prompt_tokens - prompt_tokens + 4


def test_background_loop_streams_sync_and_async(tiny_llama_ws, hf_greedy):
    with Engine(tiny_llama_ws[1], cache_block_seq_len=4, cache_max_entry_count=64) as engine:
        deltas = list(engine.generate(_prompts()[1], GREEDY))
        assert [t for d in deltas for t in d.token_ids] == hf_greedy[1]
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 10
        assert all(d.finish_reason is None for d in deltas[:-1])

        async def collect():
            streams = [engine.generate(p, GREEDY) for p in _prompts()[:3]]

            async def one(stream):
                return [t async for d in stream for t in d.token_ids]

            return await asyncio.gather(*(one(s) for s in streams))

        assert asyncio.run(collect()) == hf_greedy[:3]


def test_stop_token_ids_and_stop_words(tiny_llama_ws, hf_greedy):
    engine = _engine(tiny_llama_ws[1])
    ref = hf_greedy[2]
    stop_at = GenerationConfig(max_new_tokens=10, temperature=0, stop_token_ids=[ref[3]])
    [r] = _drain(engine, [engine.generate(_prompts()[2], stop_at)])
    assert r.token_ids == ref[: ref.index(ref[3]) + 1] and r.finish_reason == "stop"
    full = _drain(engine, [engine.generate(_prompts()[2], GREEDY)])[0].text
    word = full[len(full) // 2: len(full) // 2 + 3]
    [r] = _drain(engine, [engine.generate(_prompts()[2], GenerationConfig(max_new_tokens=10, temperature=0,
                                                                            ignore_eos=True, stop_words=[word]))])
    assert r.finish_reason == "stop" and r.text == full[: full.index(word)]
    assert engine.stats().blocks_used == 0


def test_seeded_sampling_is_reproducible_and_logprobs_come_back(tiny_llama_ws):
    engine = _engine(tiny_llama_ws[1])
    config = GenerationConfig(max_new_tokens=8, temperature=1.0, top_k=50, top_p=0.9, seed=3, ignore_eos=True,
                              logprobs=2)
    a = _drain(engine, [engine.generate(_prompts()[0], config)])[0]
    b, _ = _drain(engine, [engine.generate(_prompts()[0], config), engine.generate(_prompts()[1], config)])
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == 8 and all(lp <= 0 for lp in a.logprobs)
    assert all(len(top) == 2 for top in a.top_logprobs)


def test_prompt_longer_than_the_session_is_refused(tiny_llama_ws):
    engine = _engine(tiny_llama_ws[1], session_len=16)
    with pytest.raises(LmdError, match="session_len"):
        engine.generate(list(range(20)), GREEDY)


def test_empty_prompt_and_closed_engine_are_refused_and_close_ends_streams(tiny_llama_ws):
    engine = _engine(tiny_llama_ws[1])
    with pytest.raises(LmdError, match="empty"):
        engine.generate([], GREEDY)
    pending = engine.generate(_prompts()[0], GREEDY)
    engine.close()
    assert pending.result().finish_reason == "abort" and engine.stats().blocks_used == 0
    with pytest.raises(LmdError, match="closed"):
        engine.generate(_prompts()[0], GREEDY)


def test_a_finished_stream_has_already_released_its_request(tiny_llama_ws):
    # The last delta is put after the request is freed: whoever reads it sees the engine idle (no race with stats()).
    with Engine(tiny_llama_ws[1], cache_block_seq_len=4, cache_max_entry_count=64) as engine:
        for n in range(1, 6):
            engine.generate(_prompts()[n], GenerationConfig(max_new_tokens=n, temperature=0)).result()
            stats = engine.stats()
            assert stats.running == 0 and stats.waiting == 0 and stats.blocks_used == 0


def test_a_failing_delta_does_not_swallow_the_final_deltas_built_before_it(tiny_llama_ws, monkeypatch):
    from lmd.turbomind.request_state import RequestState

    original = RequestState.delta

    def delta(self, token, *rest):
        if self.request_id == "b":
            raise RuntimeError("detokenizer failed")
        return original(self, token, *rest)

    monkeypatch.setattr(RequestState, "delta", delta)
    engine = _engine(tiny_llama_ws[1])
    first = engine.generate(_prompts()[0], GenerationConfig(max_new_tokens=1, temperature=0), request_id="a")
    engine.generate(_prompts()[1], GenerationConfig(max_new_tokens=4, temperature=0), request_id="b")
    with pytest.raises(RuntimeError, match="detokenizer"):  # both sampled in one step: their deltas in one batch
        while engine.step():
            pass
    done = first._queue.get(timeout=5)  # a's last delta was built before b's failed: it is not lost
    assert done.finish_reason == "length" and len(done.token_ids) == 1
