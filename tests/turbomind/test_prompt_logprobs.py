"""Prompt logprobs (`GenerationConfig.prompt_logprobs`) come from the prefill's own logits: equal to HF transformers'
log-softmax over the same tokens, in one chunk or many, overlapped or not, after preemption, and never from the
prefix cache."""

from __future__ import annotations

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig


def _hf_prompt_logprobs(hf_dir, ids: list[int], k: int) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    out = [None]
    for i in range(1, len(ids)):
        top = lp[i - 1].topk(k) if k else None
        out.append((lp[i - 1, ids[i]].item(), () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist(),
                                                                                    strict=True))))
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (23, 9, 41)]


def _run(ws, configs, async_output: bool, **options):
    engine = Engine(ws, start=False, async_output=async_output, cache_block_seq_len=4, max_context_token_num=16,
                    **{"cache_max_entry_count": 64, **options})
    streams = [engine.generate(p, c, request_id=i) for i, (p, c) in enumerate(zip(_prompts(), configs, strict=True))]
    while engine.step():
        pass
    return [s.result() for s in streams], engine.stats()


def _close(ours: list, ref: list, tol: float = 1e-4) -> None:
    assert len(ours) == len(ref) and ours[0] is None and ref[0] is None
    for (lp, top), (ref_lp, ref_top) in zip(ours[1:], ref[1:], strict=True):
        assert abs(lp - ref_lp) <= tol
        assert [t for t, _ in top] == [t for t, _ in ref_top]
        assert all(abs(a - b) <= tol for (_, a), (_, b) in zip(top, ref_top, strict=True))


@pytest.mark.parametrize("async_output", [False, True])
def test_prompt_logprobs_equal_hf_log_softmax_over_chunks(tiny_llama_ws, async_output):
    configs = [GenerationConfig(max_new_tokens=3, temperature=0, prompt_logprobs=2),
               GenerationConfig(max_new_tokens=2, temperature=0),  # beside a plain request
               GenerationConfig(max_new_tokens=1, temperature=0, prompt_logprobs=0, logprobs=1)]
    results, _ = _run(tiny_llama_ws[1], configs, async_output)  # 16 tokens per step: prompts of 23 and 41 are chunked
    prompts = _prompts()
    _close(results[0].prompt_logprobs, _hf_prompt_logprobs(tiny_llama_ws[0], prompts[0], 2))
    _close(results[2].prompt_logprobs, _hf_prompt_logprobs(tiny_llama_ws[0], prompts[2], 0))
    assert results[1].prompt_logprobs is None
    plain, _ = _run(tiny_llama_ws[1], [GenerationConfig(max_new_tokens=n, temperature=0) for n in (3, 2, 1)], False)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]  # generation itself unchanged


def test_prompt_logprobs_take_nothing_from_the_prefix_cache_and_survive_preemption(tiny_llama_ws):
    engine = Engine(tiny_llama_ws[1], start=False, async_output=True, cache_block_seq_len=4, max_context_token_num=16,
                    cache_max_entry_count=64)
    prompt = _prompts()[2]
    engine.generate(prompt, GenerationConfig(max_new_tokens=1, temperature=0))  # fills the prefix cache
    while engine.step():
        pass
    before = engine.stats().prefix_hit_tokens
    stream = engine.generate(prompt, GenerationConfig(max_new_tokens=1, temperature=0, prompt_logprobs=0))
    while engine.step():
        pass
    result = stream.result()
    assert engine.stats().prefix_hit_tokens == before  # computed again, so every token has its logprob
    _close(result.prompt_logprobs, _hf_prompt_logprobs(tiny_llama_ws[0], prompt, 0))

    # six requests of 41 + 14 tokens on 14 blocks of 4: preemptions recompute prompts; each logprob comes once
    configs = [GenerationConfig(max_new_tokens=14, temperature=0, ignore_eos=True, prompt_logprobs=1)] * 3
    results, stats = _run(tiny_llama_ws[1], configs, True, cache_max_entry_count=24)
    assert stats.preemptions > 0
    for prompt, r in zip(_prompts(), results, strict=True):
        _close(r.prompt_logprobs, _hf_prompt_logprobs(tiny_llama_ws[0], prompt, 1))


def test_prompt_logprobs_config_is_checked():
    with pytest.raises(LmdError, match="prompt_logprobs"):
        GenerationConfig(prompt_logprobs=-1)
    with pytest.raises(LmdError, match="prompt_logprobs"):
        GenerationConfig(prompt_logprobs=1000)


def test_a_recomputed_chunk_past_the_prompt_plans_prompt_tokens_only():
    """After preemption a chunk may cover the prompt's end and generated tokens: only prompt tokens are targets."""
    from lmd.turbomind.prompt_logprobs import plan
    from lmd.turbomind.scheduler import ScheduledChunk

    chunk = ScheduledChunk(0, tuple(range(10)), 8, (0, 1, 2, 3, 4), True, True)  # positions 8..17, prompt of 12
    assert plan(chunk, 0, 12, 12, 0) is None  # every prompt logprob is known already
    targets = plan(chunk, 3, 12, 9, 1)  # tokens 9, 10, 11 are left; their logits are at positions 8, 9, 10
    assert (targets.first, targets.count, targets.row) == (9, 3, 3)
