"""Deploy tiny random models and rebuild the HF state dict from the workspace: exact for float, dequantized for AWQ."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lmd.arch import ARCHITECTURES
from lmd.deploy import deploy
from lmd.deploy.workspace_reader import load_rank_tensors, read_workspace_config, reconstruct_hf_state_dict
from lmd.errors import LmdError
from lmd.turbomind.kernels.w4a16_layout import awq_to_engine, dequantize, unpack_awq_int32


def _source_state(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.parametrize(("model_type", "src_dtype", "tp", "expect"), [
    ("llama", "float32", 1, torch.float16),
    ("llama", "bfloat16", 2, torch.bfloat16),
    ("mistral", "float32", 2, torch.float16),
    ("qwen2", "float32", 1, torch.float16),
    ("qwen2", "bfloat16", 2, torch.bfloat16),
    ("qwen3", "float32", 2, torch.float16),
    ("phi3", "bfloat16", 2, torch.bfloat16),  # fused qkv_proj / gate_up_proj kept fused
    ("internlm3", "float32", 1, torch.float16),
])
def test_float_round_trip_is_exact(tiny_models, tmp_path, model_type, src_dtype, tp, expect):
    src = tiny_models(model_type, src_dtype)
    ws = deploy("base", str(src), str(tmp_path / "ws"), tp=tp, progress=False)
    cfg = read_workspace_config(ws)
    assert cfg.weight_type == {torch.float16: "fp16", torch.bfloat16: "bf16"}[expect]
    rebuilt = reconstruct_hf_state_dict(ws)
    original = _source_state(src)
    assert set(rebuilt) == set(original)
    for name, tensor in original.items():
        assert rebuilt[name].dtype == expect, name
        assert torch.equal(rebuilt[name], tensor.to(expect)), name


def test_rank_files_hold_their_slices(tiny_models, tmp_path):
    src = tiny_models("qwen2")
    ws = deploy("qwen", str(src), str(tmp_path / "ws"), tp=2, progress=False)
    original = _source_state(src)
    rank1 = load_rank_tensors(ws, 1)
    q = original["model.layers.0.self_attn.q_proj.weight"].half()  # 4 heads x 32 -> rank 1 holds heads 2, 3
    k = original["model.layers.0.self_attn.k_proj.weight"].half()  # 2 kv heads -> rank 1 holds head 1
    v = original["model.layers.0.self_attn.v_proj.weight"].half()
    expected = torch.cat([q[64:128], k[32:64], v[32:64]])
    assert torch.equal(rank1["layers.0.attention.w_qkv.weight"], expected)
    bias = original["model.layers.0.self_attn.q_proj.bias"].half()
    assert bias.abs().sum() > 0
    assert torch.equal(rank1["layers.0.attention.w_qkv.bias"][:64], bias[64:128])
    gate = original["model.layers.0.mlp.gate_proj.weight"].half()
    up = original["model.layers.0.mlp.up_proj.weight"].half()
    assert torch.equal(rank1["layers.0.feed_forward.w13.weight"], torch.cat([gate[128:], up[128:]]))
    down = original["model.layers.0.mlp.down_proj.weight"].half()
    assert torch.equal(rank1["layers.0.feed_forward.w2.weight"], down[:, 128:])
    assert torch.equal(rank1["norm.weight"], load_rank_tensors(ws, 0)["norm.weight"])


def test_vocab_padded_to_tp_and_tied_embeddings(tiny_models, tmp_path):
    src = tiny_models("llama", vocab_size=49153, tie_word_embeddings=True)
    ws = deploy("base", str(src), str(tmp_path / "ws"), tp=2, progress=False)
    cfg = read_workspace_config(ws)
    assert (cfg.vocab_size, cfg.tie_word_embeddings) == (49153, 1)
    tensors = load_rank_tensors(ws, 0)
    assert "output.weight" not in tensors
    assert tensors["tok_embeddings.weight"].shape == (49154, 128)
    assert not tensors["tok_embeddings.weight"][-1].any()
    rebuilt = reconstruct_hf_state_dict(ws)
    original = _source_state(src)
    assert torch.equal(rebuilt["model.embed_tokens.weight"], original["model.embed_tokens.weight"].half())


def test_dtype_flag_float32_keeps_values(tiny_models, tmp_path):
    src = tiny_models("mistral")
    ws = deploy("mistral", str(src), str(tmp_path / "ws"), dtype="float32", progress=False)
    assert read_workspace_config(ws).weight_type == "fp32"
    rebuilt = reconstruct_hf_state_dict(ws)
    for name, tensor in _source_state(src).items():
        assert torch.equal(rebuilt[name], tensor), name


@pytest.mark.parametrize(("model_type", "group_size", "tp"), [
    ("llama", 64, 1),
    ("llama", 32, 2),
    ("mistral", 128, 1),
    ("qwen2", 64, 2),
    ("qwen3", 64, 2),
    ("phi3", 32, 2),
])
def test_awq_round_trip_matches_dequantized_checkpoint(tiny_awq, tmp_path, model_type, group_size, tp):
    src = tiny_awq(model_type, group_size)
    ws = deploy("base", str(src), str(tmp_path / "ws"), group_size=group_size, tp=tp, progress=False)
    cfg = read_workspace_config(ws)
    assert (cfg.weight_type, cfg.group_size, cfg.compute_dtype) == ("int4", group_size, "fp16")
    rebuilt = reconstruct_hf_state_dict(ws)
    ckpt = _source_state(src)
    linears = {name.removesuffix(".qweight") for name in ckpt if name.endswith(".qweight")}
    assert len(linears) == len(ARCHITECTURES[model_type].linears) * 2
    for module in linears:
        q, z, s = ckpt[f"{module}.qweight"], ckpt[f"{module}.qzeros"], ckpt[f"{module}.scales"]
        qweight, scales, zeros = awq_to_engine(q, z, s, group_size, torch.float16)
        expected = dequantize(qweight, scales.float(), zeros.float()).t()
        assert torch.equal(rebuilt[f"{module}.weight"], expected), module
        # and the engine layout is AWQ's own (code - z) * s up to the fp16 rounding of -z*s
        codes = unpack_awq_int32(q).float()
        zs = unpack_awq_int32(z).float().repeat_interleave(group_size, 0)
        awq_dense = ((codes - zs) * s.float().repeat_interleave(group_size, 0)).t()
        torch.testing.assert_close(rebuilt[f"{module}.weight"], awq_dense, atol=2e-3, rtol=0)
    for name, tensor in ckpt.items():
        if not name.endswith((".qweight", ".qzeros", ".scales")):
            assert torch.equal(rebuilt[name], tensor), name


def test_awq_rank_tensors_use_engine_layout(tiny_awq, tmp_path):
    ws = deploy("base", str(tiny_awq("llama", 64)), str(tmp_path / "ws"), group_size=64, tp=2, progress=False)
    tensors = load_rank_tensors(ws, 1)
    # qkv: K = 128 -> 16 packed rows; N per rank = (2 + 1 + 1) heads x 32 = 128
    assert tensors["layers.0.attention.w_qkv.qweight"].shape == (16, 128)
    assert tensors["layers.0.attention.w_qkv.scales"].shape == (2, 128)
    assert tensors["layers.0.attention.w_qkv.zeros"].dtype == torch.float16
    # wo row split: K per rank = 64 -> 8 packed rows, one group
    assert tensors["layers.0.attention.wo.qweight"].shape == (8, 128)
    assert tensors["layers.0.feed_forward.w2.scales"].shape == (2, 128)
    assert tensors["tok_embeddings.weight"].dtype == torch.float16


def test_awq_bf16_compute_dtype(tiny_awq, tmp_path):
    ws = deploy("base", str(tiny_awq("llama", 64)), str(tmp_path / "ws"), group_size=64, dtype="bfloat16",
                progress=False)
    assert read_workspace_config(ws).compute_dtype == "bf16"
    assert load_rank_tensors(ws, 0)["layers.1.attention.wo.scales"].dtype == torch.bfloat16


def test_pytorch_bin_checkpoint(tiny_models, tmp_path):
    import shutil

    src = shutil.copytree(tiny_models("llama"), tmp_path / "bin-model")
    state = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    torch.save(state, src / "pytorch_model.bin")
    rebuilt = reconstruct_hf_state_dict(deploy("base", str(src), str(tmp_path / "ws"), progress=False))
    for name, tensor in state.items():
        assert torch.equal(rebuilt[name], tensor.half()), name


def test_sharded_checkpoint_follows_its_index(tiny_models, tmp_path):
    import json
    import shutil

    from safetensors.torch import save_file

    src = shutil.copytree(tiny_models("mistral"), tmp_path / "sharded")
    state = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(src / file))
    weight_map = {k: file for file, keys in halves.items() for k in keys}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file({"unrelated": torch.zeros(1)}, str(src / "consolidated.safetensors"))  # not in the index: ignored
    rebuilt = reconstruct_hf_state_dict(deploy("mistral", str(src), str(tmp_path / "ws"), progress=False))
    for name, tensor in state.items():
        assert torch.equal(rebuilt[name], tensor.half()), name
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(LmdError, match="shard model-00002-of-00002.safetensors named by model.safetensors.index.json"):
        deploy("mistral", str(src), str(tmp_path / "ws2"), progress=False)


def test_awq_group_size_defaults_to_the_checkpoint(tiny_awq, tmp_path):
    ws = deploy("base", str(tiny_awq("qwen2", 32)), str(tmp_path / "ws"), progress=False)
    assert read_workspace_config(ws).group_size == 32
