"""Eager steps padded with filler tokens in the scratch block (`ModelRunner._padded`, on by default on CUDA) give
the unpadded steps' tokens and logits, and leave the block pool as they found it."""

from __future__ import annotations

import torch

from lmd.turbomind.engine import Engine
from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.gen_config import GenerationConfig


def _engine(ws, pad: bool) -> Engine:
    engine = Engine(ws, start=False, cache_block_seq_len=4, cache_max_entry_count=64, max_context_token_num=24,
                    max_batch_size=8)
    engine.runner.pad_eager = pad
    return engine


def _generate(engine: Engine) -> tuple[list[list[int]], list[list[float]]]:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 3, 13)]
    gen = [GenerationConfig(max_new_tokens=4 + i, temperature=0, ignore_eos=True, logprobs=1) for i in range(6)]
    streams = [engine.generate(p, c) for p, c in zip(prompts, gen, strict=True)]
    while engine.step():
        pass
    results = [s.result() for s in streams]
    return [r.token_ids for r in results], [list(r.logprobs) for r in results]


def test_padded_eager_steps_give_the_same_tokens_and_logprobs(tiny_llama_ws, monkeypatch) -> None:
    ids, logprobs = _generate(_engine(tiny_llama_ws[1], pad=False))
    engine = _engine(tiny_llama_ws[1], pad=True)
    sizes: list[int] = []
    build = ForwardBatch.build

    def spy(chunks, *args, **kwargs):
        sizes.append(sum(len(c[0]) for c in chunks))
        return build(chunks, *args, **kwargs)

    monkeypatch.setattr(ForwardBatch, "build", staticmethod(spy))
    padded_ids, padded_logprobs = _generate(engine)
    assert padded_ids == ids
    for got, want in zip(padded_logprobs, logprobs, strict=True):
        assert got == want or torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)
    assert sizes and all(n % 4 == 0 for n in sizes)  # block size 4: every eager step rounded up to 4 tokens
    stats = engine.stats()
    assert stats.blocks_used == 0 and stats.blocks_free == stats.blocks_total == 64


def test_padding_needs_the_scratch_block_and_fits_in_it(tiny_llama_ws) -> None:
    engine = _engine(tiny_llama_ws[1], pad=True)
    runner = engine.runner
    scratch = runner.cache.num_blocks - 1
    chunks = [([1, 2, 3], 0, [0]), ([4, 5], 6, [1, 2])]
    padded = runner._padded(chunks)
    assert padded[:2] == chunks and padded[2] == ([0] * 3, 0, [scratch])  # 5 -> 8 tokens, filler in one block
    assert runner._padded(padded) == padded  # already a multiple
    plain = Engine(tiny_llama_ws[1], start=False, cuda_graph=False, cache_block_seq_len=4)
    plain.runner.pad_eager = True
    assert plain.runner._padded(chunks) == chunks  # no scratch block: nothing to pad into
