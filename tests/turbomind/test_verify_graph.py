"""Speculative verification steps on the static buffers of the CUDA-graph path (T = 1 + K tokens per sequence), run
eagerly (no GPU here): greedy streams equal plain decoding, a step's logits equal the eager path's, padding rows stay
in the scratch block. The Triton attention on these buffers: kernels/test_verify_graph_interpret.py."""

from __future__ import annotations

import pytest
import torch

from lmd.turbomind.decode_graph import DecodeGraphs
from lmd.turbomind.engine import Engine
from lmd.turbomind.forward_batch import InflightIds
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.model_runner import ModelRunner
from lmd.turbomind.scheduler import ScheduledChunk, SchedulerOutput
from lmd.turbomind.sequence import INFLIGHT
from lmd.turbomind.speculative.config import SpeculativeConfig
from lmd.turbomind.workspace import open_workspace

K = 4
NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=K, prompt_lookup_min=1)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n in (7, 12, 5, 9, 15):
        part = torch.randint(0, 49152, (n,), generator=g).tolist()
        out.append(part + part[: n // 2] + part)  # repeats: the lookups find matches
    return out


def _generate(ws, speculative=None, graphs=False, **options) -> tuple[list[list[int]], Engine]:
    engine = Engine(ws, start=False, speculative=speculative, cache_block_seq_len=4, max_context_token_num=64,
                    cache_max_entry_count=96, max_batch_size=8, cuda_graph=graphs, **options)
    if graphs:
        engine.runner.enable_decode_graphs(capture=False)
    configs = [GenerationConfig(max_new_tokens=9 + 5 * i, temperature=0, ignore_eos=True) for i in range(5)]
    streams = [engine.generate(p, c) for p, c in zip(_prompts(), configs, strict=True)]
    while engine.step():
        pass
    stats = engine.stats()
    assert stats.blocks_free == stats.blocks_total and stats.running == 0
    return [s.result().token_ids for s in streams], engine


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_speculation_on_verification_graphs_equals_plain_decoding(tiny_llama_ws, monkeypatch, overlap) -> None:
    steps: list[tuple[int, int, list[int]]] = []  # (T, bucket, chunk lengths) of each graph step
    run = DecodeGraphs.run

    def spy(self, chunks, *rest):
        steps.append((self.tokens, self.bucket(len(chunks)), [len(c[0]) for c in chunks]))
        return run(self, chunks, *rest)

    expected, _ = _generate(tiny_llama_ws[1])
    monkeypatch.setattr(DecodeGraphs, "run", spy)
    tokens, engine = _generate(tiny_llama_ws[1], NGRAM, graphs=True, async_output=overlap)
    assert tokens == expected
    assert list(engine.runner.verify_graphs) == [1 + K]
    verify = [(b, lens) for t, b, lens in steps if t == 1 + K]
    assert engine.stats().spec_accepted_tokens > 0 and verify
    assert any(1 in lens and max(lens) > 1 for _, lens in verify)  # mixed: plain decodes beside verifications
    assert any(1 < n < 1 + K for _, lens in verify for n in lens)  # shorter proposals: rows padded inside a chunk
    assert any(b > len(lens) for b, lens in verify)  # padding sequences
    assert any(t == 1 for t, _, _ in steps)  # plain steps keep the decode graphs


def test_trees_and_eager_engines_add_no_verification_graphs(tiny_llama_ws) -> None:
    tree = SpeculativeConfig("ngram", tree=(2, 2), prompt_lookup_min=1)
    expected, _ = _generate(tiny_llama_ws[1])
    tokens, engine = _generate(tiny_llama_ws[1], tree, graphs=True)
    assert tokens == expected and engine.runner.graphs is not None and engine.runner.verify_graphs == {}
    _, eager = _generate(tiny_llama_ws[1], NGRAM, graphs=False)
    assert eager.runner.graphs is None and eager.runner.verify_graphs == {}


def _runner(ws) -> ModelRunner:
    return ModelRunner(open_workspace(ws, cache_block_seq_len=4, cache_max_entry_count=40, max_batch_size=4,
                                      session_len=128))


def _prefilled(runner: ModelRunner) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Three sequences' contexts in shuffled blocks: (step ids, tables, starts)."""
    ids = torch.randint(0, 49152, (80,), generator=torch.Generator().manual_seed(12)).tolist()
    tables = [[9, 2, 14, 30, 21], [5, 0, 11, 17, 26, 8, 33, 1, 4, 19, 12], [7, 3]]
    starts = [13, 35, 3]
    seqs = [ids[:18], ids[18:57], ids[57:61]]
    runner.run_chunks([(s[:start], 0, t) for s, start, t in zip(seqs, starts, tables, strict=True)], [])
    return [s[start:] for s, start in zip(seqs, starts, strict=True)], tables, starts


def test_verification_logits_on_static_buffers_equal_the_eager_path(tiny_llama_ws) -> None:
    runner = _runner(tiny_llama_ws[1])
    step_ids, tables, starts = _prefilled(runner)
    # a verification of 4 proposals, one of 2, a plain decode: bucket 4 (a padding sequence), rows padded to T = 5
    assert [len(s) for s in step_ids] == [5, 4, 1]
    drafts = [4, 3, 0]
    chunks = [ScheduledChunk(i, tuple(s), start, tuple(t), True, num_draft=d)
              for i, (s, start, t, d) in enumerate(zip(step_ids, starts, tables, drafts, strict=True))]
    rows = [*range(0, 5), *range(5, 9), 9]
    eager = runner.run_chunks([(list(c.token_ids), c.start, list(c.block_table)) for c in chunks], rows)
    scratch = runner.cache.num_blocks - 1
    runner.cache.k[0][scratch].fill_(float("nan"))  # padding never reads what it did not write
    runner.enable_decode_graphs(capture=False)
    runner.enable_verify_graphs(1 + K)
    graphs = runner.verify_graphs[1 + K]
    assert runner._graphs_for([(list(c.token_ids), c.start, list(c.block_table)) for c in chunks]) is graphs
    before = [runner.cache.k[0][b].clone() for t in tables for b in t]
    static = runner.run(SchedulerOutput(tuple(chunks), ()))
    assert static.shape == eager.shape == (10, eager.shape[1])
    torch.testing.assert_close(static, eager, rtol=0, atol=1e-5)
    # overlap: the plain decode's id still in flight, taken from the device
    inflight = InflightIds({2: 1}, torch.tensor([0, step_ids[2][0]]))
    patched = chunks[:2] + [ScheduledChunk(2, (INFLIGHT,), starts[2], tuple(tables[2]), True)]
    torch.testing.assert_close(runner.run(SchedulerOutput(tuple(patched), ()), inflight), eager, rtol=0, atol=1e-5)
    # only the blocks of the step's own tokens changed (same values), the rest of the real blocks untouched
    after = [runner.cache.k[0][b] for t in tables for b in t]
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6, equal_nan=True)  # unused blocks: never written


def test_a_step_of_longer_chunks_runs_eagerly(tiny_llama_ws) -> None:
    runner = _runner(tiny_llama_ws[1])
    runner.enable_decode_graphs(capture=False)
    runner.enable_verify_graphs(3)
    assert runner._graphs_for([([1, 2], 0, [0])]) is runner.verify_graphs[3]
    assert runner._graphs_for([([1], 0, [0])]) is runner.graphs
    assert runner._graphs_for([([1, 2, 3, 4], 0, [0])]) is None
    assert runner._graphs_for([([1, 2], 127, [0] * 32)]) is None  # past session_len
