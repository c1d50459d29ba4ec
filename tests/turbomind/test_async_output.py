"""Deferred output (`async_output`): a step's text is streamed while the next step runs. Every stream must be exactly
what the step-by-step engine streams: the same deltas in the same order, stop strings, stop tokens, lengths,
aborts and preemption included; a stop string only costs one computed (dropped) token."""

from __future__ import annotations

import torch

from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 3, 12)]


def _run(ws, async_output: bool, configs: list[GenerationConfig], abort_at: int | None = None, **options):
    engine = Engine(ws, start=False, async_output=async_output, cache_block_seq_len=4, max_context_token_num=24,
                    **{"cache_max_entry_count": 64, **options})
    streams = [engine.generate(p, c, request_id=i) for i, (p, c) in enumerate(zip(_prompts(), configs, strict=True))]
    steps = 0
    while engine.step():
        steps += 1
        if steps == abort_at:
            engine.abort(2)
    deltas = [[(d.text, d.token_ids, d.finish_reason) for d in s] for s in streams]  # all queued: iteration ends
    return deltas, engine.stats()


def _stop_string_configs(reference: list[str]) -> list[GenerationConfig]:
    """Stop strings cut from the middle of each request's free-running greedy text: they must hit."""
    configs = []
    for i, text in enumerate(reference):
        base = dict(max_new_tokens=[6, 12, 20, 9, 16, 3][i], temperature=0, ignore_eos=True)
        word = text[len(text) // 2:len(text) // 2 + 3] if i % 2 == 0 and len(text) > 8 else ""
        configs.append(GenerationConfig(**base, stop_words=[word] if word.strip() else None))
    return configs


def test_deferred_streams_equal_step_by_step_streams(tiny_llama_ws):
    free = [GenerationConfig(max_new_tokens=[6, 12, 20, 9, 16, 3][i], temperature=0, ignore_eos=True)
            for i in range(6)]
    plain, _ = _run(tiny_llama_ws[1], False, free)
    reference = ["".join(t for t, *_ in d) for d in plain]
    configs = _stop_string_configs(reference)
    assert sum(c.stop_words is not None for c in configs) >= 2
    ours, ours_stats = _run(tiny_llama_ws[1], True, configs)
    ref, ref_stats = _run(tiny_llama_ws[1], False, configs)
    assert ours == ref
    assert sum(d[-1][2] == "stop" for d in ours) >= 2  # the stop strings did end requests
    assert ours_stats.generated_tokens == ref_stats.generated_tokens
    assert ref_stats.computed_tokens <= ours_stats.computed_tokens <= ref_stats.computed_tokens + 6
    assert ours_stats.blocks_used == 0 and ours_stats.running == 0


def test_deferred_streams_with_preemption_and_abort(tiny_llama_ws):
    configs = [GenerationConfig(max_new_tokens=14, temperature=0, ignore_eos=True) for _ in range(6)]
    small = dict(cache_max_entry_count=14)  # 56 tokens of KV for six requests of up to 44: preemption
    ours, ours_stats = _run(tiny_llama_ws[1], True, configs, abort_at=5, **small)
    ref, ref_stats = _run(tiny_llama_ws[1], False, configs, abort_at=5, **small)
    assert ours_stats.preemptions > 0
    assert ours == ref
    assert ours[2][-1][2] == "abort" and all(d[-1][2] == "length" for i, d in enumerate(ours) if i != 2)
    assert ours_stats.blocks_used == 0


def test_overlapped_sampling_sees_every_token(tiny_llama_ws):
    """The sampling rows of an overlapped step are built after the previous step's ids are resolved: penalties,
    min_new_tokens, seeds and logprobs give the step-by-step engine's streams exactly, eos included."""
    configs = [
        GenerationConfig(max_new_tokens=12, temperature=0, repetition_penalty=1.3, logprobs=2),
        GenerationConfig(max_new_tokens=10, temperature=0.9, top_k=20, seed=5, frequency_penalty=0.8),
        GenerationConfig(max_new_tokens=9, temperature=0, presence_penalty=1.5, min_new_tokens=6),
        GenerationConfig(max_new_tokens=14, temperature=1.1, top_p=0.9, seed=7, logprobs=1, min_p=0.05),
        GenerationConfig(max_new_tokens=5, temperature=0, logit_bias=((3, 4.0),)),
        GenerationConfig(max_new_tokens=11, temperature=0.7, seed=3, repetition_penalty=0.8),
    ]

    def run(async_output: bool):
        engine = Engine(tiny_llama_ws[1], start=False, async_output=async_output, cache_block_seq_len=4,
                        max_context_token_num=24, cache_max_entry_count=64)
        streams = [engine.generate(p, c, request_id=i) for i, (p, c) in enumerate(zip(_prompts(), configs, strict=True))]
        while engine.step():
            pass
        deltas = [[(d.text, d.token_ids, d.finish_reason, d.logprobs, d.top_logprobs) for d in s] for s in streams]
        return deltas, engine.stats()

    ours, ours_stats = run(True)
    ref, ref_stats = run(False)
    assert ours == ref
    # only length ends here (no stop strings), and a token known to be the last one is never scheduled
    assert ours_stats.computed_tokens == ref_stats.computed_tokens
    assert ours_stats.blocks_cached == ref_stats.blocks_cached > 0  # blocks an in-flight id completed were committed


def test_overlapped_blocks_completed_by_an_inflight_token_are_reused(tiny_llama_ws):
    """A block that an in-flight id completes is hashed once the id is known: a later prompt made of the first
    request's prompt and output takes it from the prefix cache."""
    engine = Engine(tiny_llama_ws[1], start=False, async_output=True, cache_block_seq_len=4, max_context_token_num=24,
                    cache_max_entry_count=64)
    prompt = _prompts()[1]  # 17 tokens: the 4th block is completed by generated tokens
    first = engine.generate(prompt, GenerationConfig(max_new_tokens=8, temperature=0, ignore_eos=True), request_id=0)
    while engine.step():
        pass
    ids = [t for d in first for t in d.token_ids]
    before = engine.stats().prefix_hit_tokens
    second = engine.generate(prompt + ids + [1], GenerationConfig(max_new_tokens=1, temperature=0), request_id=1)
    while engine.step():
        pass
    list(second)
    assert engine.stats().prefix_hit_tokens - before == 24  # 17 + 8 = 25 tokens: 6 full blocks, the last one's KV
