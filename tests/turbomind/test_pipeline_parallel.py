"""Pipeline parallelism on CPU (gloo): pp stages (and tp x pp ranks) compute the logits and greedy tokens that one
process computes; the micro-batches cut every step the same way on every rank; a dead stage is one clean error."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.model_runner import ModelRunner
from lmd.turbomind.pipeline_stage import layout_lines, micro_batches, stage_layers
from lmd.turbomind.workspace import open_workspace

BLOCK = 4
A = list(range(300, 323))
B = list(range(900, 910))
C = list(range(1200, 1205))


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks: up to 4 processes on 2 cores


@pytest.fixture(scope="module")
def ws3(tmp_path_factory):
    """3 layers (stages of 2 and 1 at pp=2), tied embeddings (the last stage needs the embedding as its lm_head)."""
    from tests.conftest import deploy_tiny

    return deploy_tiny(tmp_path_factory.mktemp("pp3"), "llama", model_name="hf", num_hidden_layers=3,
                       tie_word_embeddings=True)[1]


def test_stage_layers_cover_the_model_once():
    for layers, pp in ((3, 2), (30, 4), (7, 7), (32, 3)):
        ranges = [stage_layers(layers, pp, s) for s in range(pp)]
        assert [i for r in ranges for i in r] == list(range(layers))
        assert max(len(r) for r in ranges) - min(len(r) for r in ranges) <= 1
    lines = layout_lines(3, tp=2, pp=2)
    assert lines[0].startswith("rank 0 (stage 0, tp rank 0): embedding, layers 0-1; driver")
    assert lines[3] == "rank 3 (stage 1, tp rank 1): layers 2-2, norm + lm_head; worker"


def test_micro_batches_split_chunks_and_rebase_rows():
    chunks = [([1] * 9, 0, [0]), ([2] * 3, 0, [1]), ([3] * 1, 5, [2]), ([4] * 1, 7, [3])]
    rows = [8, 11, 12, 13]  # the last position of each chunk
    parts = micro_batches(chunks, rows, 2)
    assert [len(p.chunks) for p in parts] == [1, 3]
    assert [p.rows for p in parts] == [[8], [2, 3, 4]]
    assert [len(p.chunks) for p in micro_batches(chunks, rows, 4)] == [1, 1, 1, 1]
    assert [len(p.chunks) for p in micro_batches(chunks[:1], rows[:1], 3)] == [1]  # never an empty part
    for count in (1, 2, 3, 4):
        parts = micro_batches(chunks, rows, count)
        flat = [c for p in parts for c in p.chunks]
        assert flat == chunks and sum(len(p.rows) for p in parts) == len(rows)


def _runner_logits(ws, **overrides) -> torch.Tensor:
    runner = ModelRunner(open_workspace(ws, device="cpu", dtype="fp32", cache_block_seq_len=BLOCK,
                                        cache_max_entry_count=24, **overrides))
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 20))]
    steps = [
        ([(A[:9], 0, tables[0])], [8]),
        ([(A[9:], 9, tables[0]), (B, 0, tables[1]), (C, 0, tables[2])], [13, 23, 28]),  # three micro-batches
        ([([7], len(A), tables[0]), ([8], len(B), tables[1]), ([9], len(C), tables[2])], [0, 1, 2]),
    ]
    try:
        return torch.cat([runner.run_chunks(chunks, rows) for chunks, rows in steps])
    finally:
        runner.close()


@pytest.mark.parametrize("parallel", [dict(pp=2), dict(pp=3), dict(tp=2, pp=2)])
def test_stages_compute_the_logits_of_one_process(ws3, parallel):
    expected = _runner_logits(ws3)
    got = _runner_logits(ws3, **parallel)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def _greedy(ws, prompts, **options) -> list[list[int]]:
    config = GenerationConfig(max_new_tokens=10, temperature=0, ignore_eos=True)
    with Engine(ws, device="cpu", dtype="fp32", cache_block_seq_len=BLOCK, cache_max_entry_count=40,
                max_context_token_num=16, **options) as engine:
        streams = [engine.generate(p, config) for p in prompts]
        tokens = [s.result().token_ids for s in streams]
        assert engine.stats().blocks_used == 0
        return tokens


def test_greedy_tokens_equal_one_process(ws3):
    prompts = [A, B, C, A[:13]]
    expected = _greedy(ws3, prompts)
    assert _greedy(ws3, prompts, pp=2) == expected
    assert _greedy(ws3, prompts, tp=2, pp=2) == expected


def test_refusals(ws3):
    with pytest.raises(LmdError, match="pp=4 stages but the model has 3 layers"):
        ModelRunner(open_workspace(ws3, device="cpu", pp=4))
    with pytest.raises(LmdError, match="offload-weights runs with pp=1"):
        ModelRunner(open_workspace(ws3, device="cpu", pp=2, offload_weights_gb=0.001))
    with pytest.raises(LmdError, match="pp=0 must be >= 1"):
        open_workspace(ws3, device="cpu", pp=0)


def test_a_killed_stage_is_one_clean_error(ws3):
    engine = Engine(ws3, device="cpu", dtype="fp32", cache_block_seq_len=BLOCK, cache_max_entry_count=40, pp=2)
    try:
        assert len(engine.generate(A, GenerationConfig(max_new_tokens=3, temperature=0)).result().token_ids) == 3
        worker = engine.runner.workers._procs[0]  # global rank 1: stage 1
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        result = engine.generate(B, GenerationConfig(max_new_tokens=3, temperature=0)).result()
        assert result.finish_reason == "error"
        assert "worker rank 1 (stage 1, tp rank 0) died" in str(engine.last_error)
    finally:
        engine.close()


def test_stages_read_their_layers_static_int8_kv_params(ws3, tmp_path):
    import shutil

    from tests.turbomind.test_tensor_parallel import _write_rank_kv_qparams

    ws = tmp_path / "ws"
    shutil.copytree(ws3, ws)
    _write_rank_kv_qparams(ws, tp=1, kv_heads=2, head_dim=32, layers=3)  # different params per layer
    expected = _runner_logits(ws, quant_policy=4)
    assert not (expected - _runner_logits(ws3)).abs().max() <= 1e-4 * expected.abs().max()  # int8 KV matters
    got = _runner_logits(ws, quant_policy=4, pp=2)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
