"""Tensor parallelism on CPU (gloo): rank processes compute what the whole model computes in one process, whether
they read the rank files of a workspace deployed at their TP or split another TP's weights at load."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.model_runner import ModelRunner
from lmd.turbomind.workspace import open_workspace

BLOCK = 4
# Two prompts: A prefills in two chunks, then both decode; step 2 mixes A's second chunk with B's whole prompt.
A = list(range(300, 323))
B = list(range(900, 910))


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned workers: 2 ranks on 2 cores


@pytest.fixture(scope="module")
def tp2_ws(tiny_llama_ws, tmp_path_factory):
    from lmd.deploy.converter import deploy

    return deploy(
        "hf", str(tiny_llama_ws[0]), str(tmp_path_factory.mktemp("tp2") / "ws"), tp=2, dtype="float32", progress=False
    )


def _runner_logits(ws, **overrides) -> tuple[torch.Tensor, ModelRunner]:
    """Logits of a prefill, then a mixed prefill + prefill batch, then a decode batch of two sequences."""
    runner = ModelRunner(
        open_workspace(ws, device="cpu", dtype="fp32", cache_block_seq_len=BLOCK, cache_max_entry_count=24, **overrides)
    )
    table_a, table_b = list(range(0, 8)), list(range(8, 16))
    try:
        steps = [
            ([(A[:9], 0, table_a)], [8]),
            ([(A[9:], 9, table_a), (B, 0, table_b)], [13, 23]),
            ([([7], len(A), table_a), ([8], len(B), table_b)], [0, 1]),
        ]
        logits = torch.cat([runner.run_chunks(chunks, rows) for chunks, rows in steps])
    except BaseException:
        runner.close()
        raise
    return logits, runner


def _close_to(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return bool((a - b).abs().max() <= rel * b.abs().max())


def test_tp2_logits_equal_the_merged_single_process_run(tp2_ws):
    ref, one = _runner_logits(tp2_ws, tp=1)
    ours, two = _runner_logits(tp2_ws, tp=2)
    try:
        assert two.workers is not None and one.workers is None
        assert two.cache.k[0].shape[2] == 1 and one.cache.k[0].shape[2] == 2  # a rank holds its one KV head
        assert two.model.layers[0].attention.q_heads == 2
        assert ours.shape == ref.shape == (5, 49152)
        assert _close_to(ours, ref, 1e-5)
        # the scorer's path (hidden states of one chunk) runs on every rank too
        h1 = one.hidden_states(B, 0, list(range(16, 24)))
        h2 = two.hidden_states(B, 0, list(range(16, 24)))
        assert _close_to(h2, h1, 1e-5)
    finally:
        two.close()
        one.close()


def test_tp2_greedy_generation_equals_tp1(tp2_ws):
    prompts = [list(range(100 + i, 110 + 5 * i)) for i in range(4)]
    gen = GenerationConfig(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for tp in (1, 2):
        with Engine(
            tp2_ws,
            tp=tp,
            device="cpu",
            dtype="fp32",
            cache_block_seq_len=BLOCK,
            cache_max_entry_count=64,
            max_context_token_num=16,
        ) as engine:
            streams = [engine.generate(p, gen) for p in prompts]
            outputs[tp] = [s.result().token_ids for s in streams]
            assert engine.stats().blocks_total == 64
    assert outputs[2] == outputs[1]
    assert all(len(tokens) == 12 for tokens in outputs[2])


def test_int4_tp2_equals_merged_run(tiny_llama_ws, tmp_path):
    from lmd.deploy.converter import deploy
    from tests.turbomind.awq_checkpoint import write_awq_checkpoint

    write_awq_checkpoint(tiny_llama_ws[0], tmp_path / "awq", group_size=64)
    ws = deploy("base", str(tmp_path / "awq"), str(tmp_path / "ws"), tp=2, group_size=64, dtype="float16", progress=False)
    ref, one = _runner_logits(ws, tp=1)
    one.close()
    ours, two = _runner_logits(ws, tp=2)
    try:
        assert type(two.model.layers[0].attention.wo).__name__ == "Int4Linear"
        assert two.model.layers[0].attention.wo.qweight.shape == (64 // 8, 128)  # K split in two
        assert _close_to(ours, ref, 1e-5)
    finally:
        two.close()


def _write_rank_kv_qparams(ws, tp: int, kv_heads: int, head_dim: int, layers: int) -> None:
    """Per-channel params, different for every rank: a rank reading another rank's file would quantize wrongly."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    for rank in range(tp):
        tensors = {}
        for i in range(layers):
            for name in ("k", "v"):
                shape = (kv_heads // tp, head_dim)
                tensors[f"layers.{i}.{name}_scale"] = 0.01 + 0.01 * (rank + 1) * torch.rand(shape, generator=g)
                tensors[f"layers.{i}.{name}_zero"] = 0.2 * (rank - 0.5) + 0.05 * torch.randn(shape, generator=g)
        save_file(
            tensors,
            str(ws / f"triton_models/weights/kv_qparams.rank{rank}.safetensors"),
            metadata={"kv_bits": "8", "symmetric": "0", "num_tp": str(tp), "rank": str(rank)},
        )


def test_static_int8_kv_params_are_loaded_per_rank(tp2_ws, tmp_path):
    import shutil

    ws = tmp_path / "ws"
    shutil.copytree(tp2_ws, ws)
    _write_rank_kv_qparams(ws, tp=2, kv_heads=2, head_dim=32, layers=2)
    ref, one = _runner_logits(ws, tp=1, quant_policy=4)
    one.close()
    ours, two = _runner_logits(ws, tp=2, quant_policy=4)
    try:
        assert two.kv_int8_static and two.cache.k[0].dtype == torch.int8
        assert two.cache.static.k_scale[0].shape == (1, 32)  # this rank's one KV head, per channel
        floats, plain = _runner_logits(tp2_ws, tp=1)
        plain.close()
        assert not _close_to(ours, floats, 1e-4)  # int8 KV did change the logits ...
        assert _close_to(ours, ref, 1e-5)  # ... exactly as the merged run with the concatenated params
    finally:
        two.close()


def test_a_tp_that_does_not_divide_the_heads_is_refused(tp2_ws):
    with pytest.raises(LmdError, match=r"^tp 4 does not divide head_num=4, kv_head_num=2 and inter_size=256; "
                                       r"use tp 1, 2$"):
        open_workspace(tp2_ws, tp=4)
    with pytest.raises(LmdError, match="tp=0 must be >= 1"):
        open_workspace(tp2_ws, tp=0)
    with pytest.raises(LmdError, match="tp_rank=1, pp_rank=0: .* leave them out"):
        ModelRunner(open_workspace(tp2_ws, tp=2, tp_rank=1, device="cpu"))


# TP chosen at launch: SmolLM2's head counts (9 query, 3 KV heads) at a tiny width; 3 divides both.
GQA3 = dict(hidden_size=192, intermediate_size=384, num_attention_heads=6, num_key_value_heads=3)


@pytest.fixture(scope="module")
def gqa3_src(tmp_path_factory):
    from tests.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("gqa3") / "hf", "llama", **GQA3)


@pytest.fixture(scope="module")
def gqa3_ws(gqa3_src, tmp_path_factory):
    from lmd.deploy.converter import deploy

    return deploy("hf", str(gqa3_src), str(tmp_path_factory.mktemp("gqa3-ws") / "ws"), dtype="float32",
                  progress=False)


def test_tp3_on_a_tp1_workspace_splits_the_weights_at_load(gqa3_ws):
    ref, one = _runner_logits(gqa3_ws, tp=1)
    one.close()
    ours, three = _runner_logits(gqa3_ws, tp=3)
    try:
        assert three.workers is not None and len(three.workers._procs) == 2
        assert three.cache.k[0].shape[2] == 1 and three.model.layers[0].attention.q_heads == 2
        assert _close_to(ours, ref, 1e-5)
    finally:
        three.close()


def test_tp3_greedy_tokens_equal_tp1_and_the_deployed_tp3_files(gqa3_src, gqa3_ws, tmp_path):
    from lmd.deploy.converter import deploy

    ws3 = deploy("hf", str(gqa3_src), str(tmp_path / "ws3"), tp=3, dtype="float32", progress=False)
    prompts = [list(range(100 + i, 110 + 5 * i)) for i in range(3)]
    gen = GenerationConfig(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    runs = {}
    for name, ws, tp in (("tp1", gqa3_ws, 1), ("tp3 split at load", gqa3_ws, 3), ("tp3 rank files", ws3, 3),
                         ("tp1 merged", ws3, 1)):
        with Engine(ws, tp=tp, device="cpu", dtype="fp32", cache_block_seq_len=BLOCK, cache_max_entry_count=48,
                    max_context_token_num=16) as engine:
            runs[name] = [s.result().token_ids for s in [engine.generate(p, gen) for p in prompts]]
    assert all(tokens == runs["tp1"] for tokens in runs.values()), runs


def test_int4_and_static_kv_params_split_at_load(gqa3_src, tmp_path):
    from lmd.deploy.converter import deploy
    from tests.turbomind.awq_checkpoint import write_awq_checkpoint

    write_awq_checkpoint(gqa3_src, tmp_path / "awq", group_size=32)
    ws = deploy("base", str(tmp_path / "awq"), str(tmp_path / "ws"), group_size=32, dtype="float16", progress=False)
    _write_rank_kv_qparams(ws, tp=1, kv_heads=3, head_dim=32, layers=2)  # deployed at tp 1: one file, 3 KV heads
    ref, one = _runner_logits(ws, tp=1, quant_policy=4)
    one.close()
    ours, three = _runner_logits(ws, tp=3, quant_policy=4)
    try:
        wo = three.model.layers[0].attention.wo
        assert type(wo).__name__ == "Int4Linear" and wo.qweight.shape == (64 // 8, 192)  # K = 192 / 3
        assert three.kv_int8_static and three.cache.static.k_scale[0].shape == (1, 32)
        assert _close_to(ours, ref, 1e-5)
    finally:
        three.close()


def test_a_killed_worker_is_an_error_not_a_hang(tp2_ws):
    engine = Engine(tp2_ws, tp=2, device="cpu", cache_block_seq_len=BLOCK, cache_max_entry_count=16)
    try:
        first = engine.generate(A, GenerationConfig(max_new_tokens=2, temperature=0.0, ignore_eos=True)).result()
        assert first.finish_reason == "length"
        worker = engine.runner.workers._procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        result = engine.generate(B, GenerationConfig(max_new_tokens=2)).result()
        assert result.finish_reason == "error"
        assert isinstance(engine.last_error, LmdError)
        assert "worker rank 1 (stage 0, tp rank 1) died" in str(engine.last_error)
        with pytest.raises(LmdError, match="already runs a tensor-parallel engine"):
            ModelRunner(open_workspace(tp2_ws, tp=2, device="cpu", cache_max_entry_count=16))
    finally:
        engine.close()
    assert engine.runner.workers is None
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_pipeline_runs_tp2_like_tp1(tp2_ws):
    import lmd

    gen = GenerationConfig(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    options = dict(device="cpu", dtype="fp32", cache_block_seq_len=BLOCK, cache_max_entry_count=32)
    with lmd.pipeline(tp2_ws, tp=2, **options) as pipe:
        assert pipe.engine.runner.workers is not None
        ours = pipe([A, B], gen)
    with lmd.pipeline(tp2_ws, **options) as pipe:
        ref = pipe([A, B], gen)
    assert [r.token_ids for r in ours] == [r.token_ids for r in ref]


def test_a_driver_failure_mid_forward_stops_the_workers(tp2_ws):
    runner = ModelRunner(open_workspace(tp2_ws, tp=2, device="cpu", cache_block_seq_len=BLOCK, cache_max_entry_count=8))
    try:
        procs = list(runner.workers._procs)

        def boom(x):
            raise RuntimeError("boom")

        runner.model.layers[1].mlp = boom  # rank 1 is left waiting in layer 1's MLP all-reduce
        for _ in range(2):  # the ranks are out of step: every later step fails the same way
            with pytest.raises(LmdError, match=r"a model-parallel step failed \(boom\); close this engine"):
                runner.run_chunks([(B, 0, [0, 1, 2])], [9])
        assert not any(p.is_alive() for p in procs)
    finally:
        runner.close()


@pytest.mark.slow
def test_smollm2_deployed_at_tp1_runs_at_tp3(smollm2_hf, tmp_path):
    """The real model (9 query heads, 3 KV heads): tp 3 from a tp 1 workspace gives tp 1's logits and greedy reply."""
    import lmd
    from lmd.deploy.converter import deploy

    ws = deploy("hf", str(smollm2_hf), str(tmp_path / "ws"), dtype="float32", progress=False)
    ref, one = _runner_logits(ws, tp=1)
    one.close()
    ours, three = _runner_logits(ws, tp=3)
    three.close()
    assert _close_to(ours, ref, 1e-4)
    gen = GenerationConfig(max_new_tokens=12, temperature=0.0)
    prompts = [[{"role": "user", "content": "What is the capital of France?"}]]
    replies = {}
    for tp in (1, 3):
        with lmd.pipeline(ws, tp=tp, device="cpu", dtype="fp32", cache_max_entry_count=64) as pipe:
            replies[tp] = [r.token_ids for r in pipe(prompts, gen)]
    assert replies[3] == replies[1]
