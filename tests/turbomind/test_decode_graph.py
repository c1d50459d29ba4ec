"""Decode steps on the static buffers of the CUDA-graph path give the plain path's tokens (run eagerly: no GPU here;
the capture itself is checked by benchmarks/gpu_engine_check.py on a GPU)."""

from __future__ import annotations

import pytest

from lmd.errors import LmdError
from lmd.turbomind.decode_graph import batch_buckets
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig


def _engine(ws, **overrides) -> Engine:
    options = dict(cache_block_seq_len=4, cache_max_entry_count=64, max_context_token_num=24, max_batch_size=8)
    options.update(overrides)
    return Engine(ws, start=False, **options)


def _generate(engine: Engine) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 3, 12)]
    # different lengths: the decode batch shrinks 6 -> 1, through buckets 8, 4, 2 and 1 with padding rows
    streams = [engine.generate(p, GenerationConfig(max_new_tokens=3 + 2 * i, temperature=0, ignore_eos=True))
               for i, p in enumerate(prompts)]
    while engine.step():
        pass
    return [s.result().token_ids for s in streams]


def test_buckets_step_by_eight_up_to_the_largest_batch() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(257)[-3:] == [248, 256, 257] and len(batch_buckets(256)) == 35


def test_cpu_engine_keeps_a_scratch_block_and_captures_nothing(tiny_llama_ws) -> None:
    engine = _engine(tiny_llama_ws[1])
    assert engine.runner.graphs is None
    assert engine.runner.num_blocks == engine.runner.cache.num_blocks - 1 == 64
    plain = _engine(tiny_llama_ws[1], cuda_graph=False)
    assert plain.runner.num_blocks == plain.runner.cache.num_blocks == 64
    with pytest.raises(LmdError, match="scratch block"):
        plain.runner.enable_decode_graphs(capture=False)


def test_static_decode_buffers_give_the_plain_paths_tokens(tiny_llama_ws, monkeypatch) -> None:
    expected = _generate(_engine(tiny_llama_ws[1], cuda_graph=False))
    engine = _engine(tiny_llama_ws[1])
    engine.runner.enable_decode_graphs(capture=False)
    graphs, sizes = engine.runner.graphs, []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda chunks, *rest: sizes.append(len(chunks)) or run(chunks, *rest))
    assert _generate(engine) == expected
    assert {graphs.bucket(n) for n in sizes} == {8, 4, 2, 1}
    assert any(n not in graphs.buckets for n in sizes)  # batches padded to their bucket
    stats = engine.stats()
    assert stats.blocks_used == 0 and stats.blocks_free == stats.blocks_total == 64
