"""KV int8 (quant_policy = 4): quantization error bounds, twice the blocks of fp16, logits close to float KV."""

from __future__ import annotations

import shutil

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind import kv_cache, kv_int8
from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.model_runner import ModelRunner
from lmd.turbomind.workspace import open_workspace


def test_online_quantization_error_is_within_half_a_step():
    x = torch.randn(7, 3, 64) * torch.linspace(0.1, 10, 7)[:, None, None]
    scale, zero = kv_int8.online_params(x)
    q = kv_int8.quantize(x, scale[..., None], zero[..., None])
    back = kv_int8.dequantize(q, scale[..., None], zero[..., None], torch.float32)
    assert (back - x).abs().le(scale[..., None].float() * 0.5 + 1e-6).all()
    assert q.min() >= -128 and q.max() <= 127
    # the step fits each row's range: both ends reach the outer codes (a step twice too wide would stop at +-64)
    assert (q.amax(-1) == 127).all() and (q.amin(-1) == -127).all()


def test_int8_doubles_the_blocks_of_fp16(monkeypatch):
    monkeypatch.setattr(kv_cache, "_available_ram", lambda: 1 << 30)
    dims = (30, 64, 3, 64)  # SmolLM2: layers, block, kv heads, head dim
    fp16 = kv_cache.block_bytes(*dims, torch.float16, int8=False, static=False)
    static = kv_cache.block_bytes(*dims, torch.float16, int8=True, static=True)
    assert fp16 == 2 * static
    cpu = torch.device("cpu")
    n16 = kv_cache.plan_num_blocks(0.5, fp16, cpu, max_useful_blocks=10**9)
    assert kv_cache.plan_num_blocks(0.5, static, cpu, max_useful_blocks=10**9) == 2 * n16
    online = kv_cache.block_bytes(*dims, torch.float16, int8=True, static=False)
    assert kv_cache.plan_num_blocks(0.5, online, cpu, max_useful_blocks=10**9) > 1.8 * n16


def _logits(ws, ids, **overrides) -> torch.Tensor:
    runner = ModelRunner(open_workspace(ws, cache_block_seq_len=4, cache_max_entry_count=16, **overrides))
    batch = ForwardBatch.build([(ids[:20], 0, list(range(16)))], 4, list(range(20)), runner.device)
    first = runner.model.forward(batch, runner.cache)
    batch = ForwardBatch.build([(ids[20:], 20, list(range(16)))], 4, list(range(len(ids) - 20)), runner.device)
    return torch.cat([first, runner.model.forward(batch, runner.cache)]), runner


def _write_static_params(ws, runner, num_tokens: int, per_channel: bool = False) -> None:
    """Per layer and KV head (or head and channel) min/max over the tokens in the float cache -> asymmetric int8."""
    from safetensors.torch import save_file

    tensors = {}
    for i in range(len(runner.cache.k)):
        for name, cache in (("k", runner.cache.k[i]), ("v", runner.cache.v[i])):
            x = cache.flatten(0, 1)[:num_tokens].float()  # blocks 0.. hold the sequence in order
            dims = 0 if per_channel else (0, 2)
            hi, lo = x.amax(dim=dims), x.amin(dim=dims)
            tensors[f"layers.{i}.{name}_scale"] = (hi - lo) / 255
            tensors[f"layers.{i}.{name}_zero"] = (hi + lo) / 2
    save_file(tensors, str(ws / "triton_models/weights/kv_qparams.rank0.safetensors"),
              metadata={"kv_bits": "8", "symmetric": "0", "num_tp": "1"})


def test_int8_kv_logits_stay_close_to_float_kv(tiny_llama_ws, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(tiny_llama_ws[1], ws)
    ids = torch.randint(0, 49152, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    ref, runner = _logits(ws, ids)
    online, _ = _logits(ws, ids, quant_policy=4)
    _write_static_params(ws, runner, len(ids))
    static, static_runner = _logits(ws, ids, quant_policy=4)
    assert static_runner.kv_int8_static and static_runner.cache.k[0].dtype == torch.int8
    span = (ref.amax(-1) - ref.amin(-1)).max()
    # spread over 10 id seeds x 2 package sets: online 0.0022..0.0034 span, static 0.0035..0.0056; bounds 6x and 9x
    assert (online - ref).abs().max() < 0.02 * span
    assert (static - ref).abs().max() < 0.05 * span
    assert not torch.equal(online, ref) and not torch.equal(static, online)


def test_per_channel_static_params_are_read_and_beat_per_head(tiny_llama_ws, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(tiny_llama_ws[1], ws)
    ids = torch.randint(0, 49152, (37,), generator=torch.Generator().manual_seed(6)).tolist()
    ref, runner = _logits(ws, ids)
    _write_static_params(ws, runner, len(ids))
    per_head, head_runner = _logits(ws, ids, quant_policy=4)
    _write_static_params(ws, runner, len(ids), per_channel=True)
    per_channel, channel_runner = _logits(ws, ids, quant_policy=4)
    heads, dim = runner.cache.k[0].shape[-2:]
    assert head_runner.cache.static.k_scale[0].shape == (heads, 1)
    assert channel_runner.cache.static.k_scale[0].shape == (heads, dim)
    assert channel_runner.bytes_per_block == head_runner.bytes_per_block
    # per-channel / per-head mean error over 10 id seeds x 2 package sets: 0.53..0.80
    assert 0 < (per_channel - ref).abs().mean() < (per_head - ref).abs().mean()


def test_static_params_of_the_wrong_shape_are_refused(tiny_llama_ws, tmp_path):
    from safetensors.torch import save_file

    ws = tmp_path / "ws"
    shutil.copytree(tiny_llama_ws[1], ws)
    save_file({"layers.0.k_scale": torch.ones(5)}, str(ws / "triton_models/weights/kv_qparams.rank0.safetensors"))
    with pytest.raises(LmdError, match="kv-qparams"):
        ModelRunner(open_workspace(ws, quant_policy=4, cache_max_entry_count=4))
