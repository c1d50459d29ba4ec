"""The engine's model over the paged cache vs transformers: chunked prefill and decodes of two sequences mixed."""

from __future__ import annotations

import pytest
import torch

from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.kv_cache import KVCache
from lmd.turbomind.model_runner import ModelRunner
from lmd.turbomind.workspace import open_workspace
from tests.conftest import deploy_tiny

BLOCK = 4


def _hf_logits(src, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _engine_logits(ws, a: list[int], b: list[int], split: int, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a (prefill in two chunks, then one decode) and b (one prefill, then one decode) interleaved."""
    runner = ModelRunner(open_workspace(ws, cache_block_seq_len=BLOCK, cache_max_entry_count=32, **overrides))
    model, cache = runner.model, runner.cache
    ta, tb = list(range(0, 16)), list(range(16, 32))
    dev = runner.device
    step1 = ForwardBatch.build([(a[:split], 0, ta), (b[:-1], 0, tb)], BLOCK, list(range(split + len(b) - 1)), dev)
    out1 = model.forward(step1, cache)
    n = len(a) - 1 - split
    step2 = ForwardBatch.build([(b[-1:], len(b) - 1, tb), (a[split:-1], split, ta)], BLOCK, list(range(1 + n)), dev)
    out2 = model.forward(step2, cache)
    step3 = ForwardBatch.build([(a[-1:], len(a) - 1, ta)], BLOCK, [0], dev)
    out3 = model.forward(step3, cache)
    la = torch.cat([out1[:split], out2[1:], out3])
    lb = torch.cat([out1[split:], out2[:1]])
    return la, lb


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _longrope(head_dim: int, partial: float = 1.0) -> dict:
    """Phi-3.5 / Phi-4-mini's RoPE at a tiny scale: pretrained to 64 positions, extended to 512."""
    pairs = int(head_dim * partial) // 2
    g = torch.Generator().manual_seed(pairs)
    return {"max_position_embeddings": 512, "original_max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
        "original_max_position_embeddings": 64, "short_factor": (1 + torch.rand(pairs, generator=g)).tolist(),
        "long_factor": (2 + 6 * torch.rand(pairs, generator=g)).tolist()}}


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_matches_transformers_on_both_sides_of_the_pretraining_length(tmp_path, partial):
    """A whole prompt shorter and one longer than original_max_position_embeddings, then decode steps that cross it
    (transformers picks the factors per forward by its longest position: per token's sequence here)."""
    src, ws = deploy_tiny(tmp_path, "phi3", **_longrope(32, partial))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert hf.model.rotary_emb.rope_type == "longrope" and hf.model.rotary_emb.attention_scaling > 1.1
    runner = ModelRunner(open_workspace(ws, cache_block_seq_len=BLOCK, cache_max_entry_count=64))
    for n, table in ((40, list(range(10))), (100, list(range(10, 35)))):
        ids = _ids(n, n)
        batch = ForwardBatch.build([(ids, 0, table)], BLOCK, list(range(n)), runner.device)
        with torch.no_grad():
            assert (runner.model.forward(batch, runner.cache) - hf(torch.tensor([ids])).logits[0]).abs().max() < 1e-4
    ids, table = _ids(70, 7), list(range(35, 53))
    batch = ForwardBatch.build([(ids[:60], 0, table)], BLOCK, [59], runner.device)
    runner.model.forward(batch, runner.cache)
    with torch.no_grad():
        out = hf(torch.tensor([ids[:60]]), use_cache=True)
        cache = out.past_key_values
        for p in range(60, 70):  # positions 63 -> 64 -> 65: the factors switch at the 65th token
            step = hf(torch.tensor([[ids[p]]]), past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            ours = runner.model.forward(ForwardBatch.build([(ids[p:p + 1], p, table)], BLOCK, [0], runner.device),
                                        runner.cache)
            assert (ours[0] - step.logits[0, -1]).abs().max() < 1e-4, p


@pytest.mark.parametrize(("model_type", "overrides"), [
    ("llama", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", {}), ("internlm3", {}),
    ("phi3", {}),  # fused qkv_proj / gate_up_proj in the checkpoint
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
], ids=["llama", "mistral", "qwen2", "qwen3", "internlm3", "phi3", "phi3-partial-rotary"])
def test_forward_matches_transformers(tmp_path, model_type, overrides):
    src, ws = deploy_tiny(tmp_path, model_type, randomize_bias=model_type == "qwen2", **overrides)
    a, b = _ids(23, 0), _ids(10, 1)
    la, lb = _engine_logits(ws, a, b, split=9)
    assert (la - _hf_logits(src, a)).abs().max() < 1e-4
    assert (lb - _hf_logits(src, b)).abs().max() < 1e-4


def test_unfused_attention_matches_transformers(tmp_path):
    src, ws = deploy_tiny(tmp_path, "llama")
    a, b = _ids(23, 5), _ids(10, 6)
    la, lb = _engine_logits(ws, a, b, split=9, use_context_fmha=False)
    assert (la - _hf_logits(src, a)).abs().max() < 1e-4
    assert (lb - _hf_logits(src, b)).abs().max() < 1e-4


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
])
def test_rope_scaling_matches_transformers(tmp_path, rope):
    src, ws = deploy_tiny(tmp_path, "llama", rope_scaling=rope)
    a, b = _ids(30, 2), _ids(7, 3)
    la, lb = _engine_logits(ws, a, b, split=13)
    assert (la - _hf_logits(src, a)).abs().max() < 1e-4
    assert (lb - _hf_logits(src, b)).abs().max() < 1e-4


def test_dynamic_ntk_matches_transformers_for_a_whole_prompt(tmp_path):
    # HF rescales dynamic NTK from the current length; a prompt longer than max_position_embeddings in one forward
    src, ws = deploy_tiny(tmp_path, "llama", max_position_embeddings=16, rope_scaling={"rope_type": "dynamic",
                                                                                       "factor": 2.0})
    a = _ids(29, 4)
    runner = ModelRunner(open_workspace(ws, cache_block_seq_len=BLOCK, cache_max_entry_count=16))
    batch = ForwardBatch.build([(a, 0, list(range(8)))], BLOCK, list(range(len(a))), runner.device)
    assert (runner.model.forward(batch, runner.cache) - _hf_logits(src, a)).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kv_cache_reads_a_sequence_back_through_its_block_table(dtype):
    cache = KVCache(num_layers=1, num_blocks=4, block_size=2, kv_heads=2, head_dim=8, dtype=dtype,
                    device=torch.device("cpu"))
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cache.write(0, k, v, torch.tensor([4, 5, 0]))  # block table [2, 0]: tokens 0, 1 in block 2, token 2 in block 0
    rk, rv = cache.read(0, torch.tensor([2, 0]), 3)
    assert torch.equal(rk, k.to(dtype)) and torch.equal(rv, v.to(dtype))


@pytest.mark.parametrize("int4", [False, True])
def test_tensor_parallel_workspace_runs_merged_in_one_process(tiny_llama_ws, tmp_path, int4):
    from lmd.deploy.converter import deploy

    if int4:
        from tests.turbomind.awq_checkpoint import write_awq_checkpoint

        write_awq_checkpoint(tiny_llama_ws[0], tmp_path / "awq", group_size=64)
        src, options = tmp_path / "awq", dict(group_size=64, dtype="float16")
    else:
        src, options = tiny_llama_ws[0], dict(dtype="float32")
    one = deploy("base", str(src), str(tmp_path / "tp1"), progress=False, **options)
    two = deploy("base", str(src), str(tmp_path / "tp2"), tp=2, progress=False, **options)
    a, b = _ids(23, 0), _ids(10, 1)
    la1, lb1 = _engine_logits(one, a, b, split=9, dtype="fp32")
    la2, lb2 = _engine_logits(two, a, b, split=9, dtype="fp32")
    assert torch.allclose(la1, la2, atol=1e-5) and torch.allclose(lb1, lb2, atol=1e-5)
