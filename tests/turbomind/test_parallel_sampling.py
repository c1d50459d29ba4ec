"""Parallel sampling (`GenerationConfig(n=..., best_of=...)`, `Engine.generate_samples`): one prefill, forked
sequences sharing the prompt's full KV blocks, the partly filled last block copied; each sample equals what a
single request with the same generator draws; blocks all come back."""

from __future__ import annotations

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.request_stream import best_by_logprob


def _prompt(n: int = 22) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _engine(ws, async_output: bool, **options) -> Engine:
    return Engine(ws, start=False, async_output=async_output, cache_block_seq_len=4, max_context_token_num=16,
                  **{"cache_max_entry_count": 64, **options})


def _drain(engine: Engine) -> None:
    while engine.step():
        pass


@pytest.mark.parametrize("async_output", [False, True])
def test_samples_come_from_one_prefill_and_equal_single_requests(tiny_llama_ws, async_output):
    prompt = _prompt()  # 22 tokens: 5 full blocks of 4 and a partly filled one (copied at the fork)
    config = GenerationConfig(n=3, max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0, seed=11, ignore_eos=True)
    engine = _engine(tiny_llama_ws[1], async_output)
    streams = engine.generate_samples(prompt, config, request_id="r")
    _drain(engine)
    results = [s.result() for s in streams]
    assert [s.request_id for s in streams] == [("r", 0), ("r", 1), ("r", 2)]
    stats = engine.stats()
    assert stats.computed_tokens == len(prompt) + 3 * 7  # one prefill; each sample feeds 7 tokens back
    assert stats.blocks_used == 0 and stats.running == 0
    assert len({tuple(r.token_ids) for r in results}) == 3  # different samples
    for i, result in enumerate(results):  # sample i draws what a lone request seeded with seed + i draws
        alone = _engine(tiny_llama_ws[1], False)
        single = alone.generate(prompt, GenerationConfig(**{**_fields(config), "n": 1, "seed": 11 + i}))
        _drain(alone)
        assert single.result().token_ids == result.token_ids
        assert result.usage.prompt_tokens == len(prompt) and result.usage.completion_tokens == 8


def _fields(config: GenerationConfig) -> dict:
    from dataclasses import fields

    return {f.name: getattr(config, f.name) for f in fields(config)}


def test_forks_share_full_blocks_by_reference(tiny_llama_ws):
    engine = _engine(tiny_llama_ws[1], True)
    prompt = _prompt(21)
    streams = engine.generate_samples(prompt, GenerationConfig(n=4, max_new_tokens=30, temperature=0.8, seed=1,
                                                               ignore_eos=True))
    for _ in range(4):  # prefill (two chunks) and the fork
        engine.step()
    running = engine.scheduler.running
    assert len(running) == 4
    shared = running[0].block_table[:5]
    assert all(seq.block_table[:5] == shared for seq in running)  # 5 full blocks, shared
    assert all(engine.block_manager.blocks[b].ref_count == 4 for b in shared)
    assert len({seq.block_table[5] for seq in running}) == 4  # the partly filled block: one copy each
    _drain(engine)
    assert all(len(s.result().token_ids) == 30 for s in streams)
    assert engine.stats().blocks_used == 0


def test_best_of_keeps_the_highest_cumulative_logprob(tiny_llama_ws):
    engine = _engine(tiny_llama_ws[1], True)
    config = GenerationConfig(n=2, best_of=5, max_new_tokens=6, temperature=1.2, top_k=0, top_p=1.0, seed=3)
    streams = engine.generate_samples(_prompt(9), config)
    _drain(engine)
    results = [s.result() for s in streams]
    assert len(results) == 5 and all(r.logprobs is not None for r in results)  # ranking needs them
    best = best_by_logprob(results, 2)
    totals = sorted((sum(r.logprobs) for r in results), reverse=True)
    assert [sum(r.logprobs) for r in best] == totals[:2]


def test_parallel_sampling_survives_preemption_and_abort(tiny_llama_ws):
    engine = _engine(tiny_llama_ws[1], True, cache_max_entry_count=16)  # 64 tokens of KV for 3 x (13 + 20)
    streams = engine.generate_samples(_prompt(13), GenerationConfig(n=3, max_new_tokens=20, temperature=0.7,
                                                                    seed=5, ignore_eos=True), request_id="p")
    other = engine.generate(_prompt(10), GenerationConfig(max_new_tokens=12, temperature=0, ignore_eos=True))
    for _ in range(6):
        engine.step()
    engine.abort(("p", 1))
    _drain(engine)
    assert engine.stats().preemptions > 0
    assert streams[1].result().finish_reason == "abort"
    assert [len(streams[i].result().token_ids) for i in (0, 2)] == [20, 20] and len(other.result().token_ids) == 12
    assert engine.stats().blocks_used == 0


def test_parallel_sampling_errors(tiny_llama_ws):
    engine = _engine(tiny_llama_ws[1], False, max_batch_size=4)
    with pytest.raises(LmdError, match="generate_samples"):
        engine.generate(_prompt(), GenerationConfig(n=2))
    with pytest.raises(LmdError, match="max_batch_size"):
        engine.generate_samples(_prompt(), GenerationConfig(n=5))
    with pytest.raises(LmdError, match="best_of"):
        GenerationConfig(n=3, best_of=2)
    with pytest.raises(LmdError, match="GenerationConfig.n"):
        GenerationConfig(n=0)


def test_forks_to_come_count_against_max_batch_size(tiny_llama_ws):
    """A request of n samples takes n batch slots from its admission on, so requests admitted after it (before it
    forks) never push the batch past max_batch_size."""
    engine = _engine(tiny_llama_ws[1], True, max_batch_size=4)
    group = engine.generate_samples(_prompt(5), GenerationConfig(n=3, max_new_tokens=6, temperature=0.8, seed=2))
    others = [engine.generate(_prompt(6 + i), GenerationConfig(max_new_tokens=6, temperature=0, ignore_eos=True))
              for i in range(2)]
    most = 0
    while engine.step():
        most = max(most, len(engine.scheduler.running))
    assert most == 4  # the three samples and one other request; the second waits for a slot
    assert all(s.result().finish_reason for s in group + others)
    assert engine.stats().blocks_used == 0
