"""Calibration statistics against direct computations on a full HF forward (tiny llama, mistral, qwen2 and qwen3
models)."""

from __future__ import annotations

import pytest
import torch

from lmd.lite.calib_stats import ChannelObserver, HeadObserver
from lmd.lite.calibrate import collect_stats
from tests.conftest import build_tiny_model

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")


def _ids(n: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 4000, (n, length), generator=torch.Generator().manual_seed(seed))


def _load(path, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()


def _full_forward_captures(model, input_ids: torch.Tensor):
    """Every linear's input and every linear/norm's output, plus the KV cache, from one plain full-model forward."""
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            handles.append(module.register_forward_pre_hook(
                lambda _m, args, name=name: inputs.__setitem__(name, args[0].detach())))
        if isinstance(module, torch.nn.Linear) and name != "lm_head" or name.endswith(NORMS) or name == "model.norm":
            handles.append(module.register_forward_hook(
                lambda _m, _a, out, name=name: outputs.__setitem__(name, out.detach())))
    with torch.no_grad():
        cache = model(input_ids, use_cache=True).past_key_values
    for handle in handles:
        handle.remove()
    return inputs, outputs, cache


def _channel_reference(x: torch.Tensor) -> dict[str, torch.Tensor]:
    flat = x.reshape(-1, x.shape[-1]).double()
    return {"max": flat.amax(0), "min": flat.amin(0), "absmax": flat.abs().amax(0), "mean": flat.mean(0),
            "absmean": flat.abs().mean(0)}


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {}),                              # GQA 4 heads / 2 kv heads
    ("llama", {"num_key_value_heads": 4}),      # MHA
    ("mistral", {}),
    ("qwen2", {}),                              # qkv bias: values/keys include it
    ("qwen3", {"head_dim": 32}),                # per-head k norm before RoPE: keys after it
])
def test_stats_match_full_forward(tmp_path, model_type, overrides):
    model = _load(build_tiny_model(tmp_path / "m", model_type, **overrides))
    input_ids = _ids(5, 24)
    ref_in, ref_out, cache = _full_forward_captures(model, input_ids)

    exported = collect_stats(model, input_ids, "cpu", batch_size=2).export()

    for i in range(model.config.num_hidden_layers):
        layer = f"model.layers.{i}"
        keys, values = cache.layers[i].keys, cache.layers[i].values  # [batch, kv_heads, seq, head_dim]
        for stats, cached in ((exported["key_stats"], keys), (exported["value_stats"], values)):
            # keys/values come out of the same layer ops as the cache; run layer-by-layer, exact equality holds
            # only when batching does not change the matmul, so compare to float32 rounding.
            torch.testing.assert_close(stats["max"][layer], cached.amax(dim=(0, 2)), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(stats["min"][layer], cached.amin(dim=(0, 2)), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(stats["absmax"][layer], cached.abs().amax(dim=(0, 2)), rtol=1e-5, atol=1e-6)
            assert stats["max"][layer].shape == (model.config.num_key_value_heads, 32)
        for rel in LINEARS:
            name = f"{layer}.{rel}"
            ref = _channel_reference(ref_in[name])
            for stat, value in ref.items():
                torch.testing.assert_close(exported["inputs_stats"][stat][name].double(), value, rtol=1e-4, atol=1e-5)
        for rel in (*LINEARS, *NORMS):
            name = f"{layer}.{rel}"
            ref = _channel_reference(ref_out[name])
            for stat, value in ref.items():
                torch.testing.assert_close(exported["outputs_stats"][stat][name].double(), value, rtol=1e-4, atol=1e-5)
    final = _channel_reference(ref_out["model.norm"])
    torch.testing.assert_close(exported["outputs_stats"]["max"]["model.norm"].double(), final["max"],
                               rtol=1e-4, atol=1e-5)


def test_keys_are_post_rope_exactly_as_cached(tiny_llama):
    """One chunk holding all samples runs the same ops as the full forward: bitwise-equal key/value stats."""
    model = _load(tiny_llama)
    input_ids = _ids(3, 40, seed=1)
    _, _, cache = _full_forward_captures(model, input_ids)
    exported = collect_stats(model, input_ids, "cpu", batch_size=3).export()
    for i in range(2):
        keys = cache.layers[i].keys
        assert torch.equal(exported["key_stats"]["max"][f"model.layers.{i}"], keys.amax(dim=(0, 2)))
        assert torch.equal(exported["key_stats"]["min"][f"model.layers.{i}"], keys.amin(dim=(0, 2)))
        assert torch.equal(exported["value_stats"]["absmax"][f"model.layers.{i}"],
                           cache.layers[i].values.abs().amax(dim=(0, 2)))
    # pre-RoPE keys would differ: the k_proj output of layer 0 has a different per-dim max at positions > 0
    pre = {}
    handle = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda _m, _a, out: pre.setdefault("k", out))
    with torch.no_grad():
        model(input_ids)
    handle.remove()
    pre_max = pre["k"].view(3, 40, 2, 32).amax(dim=(0, 1))
    assert not torch.allclose(pre_max, exported["key_stats"]["max"]["model.layers.0"])


def test_stats_do_not_depend_on_batch_size(tiny_llama):
    model = _load(tiny_llama)
    input_ids = _ids(4, 16, seed=2)
    one = collect_stats(model, input_ids, "cpu", batch_size=1).export()
    four = collect_stats(model, input_ids, "cpu", batch_size=4).export()
    for stem in one:
        for stat in one[stem]:
            assert one[stem][stat].keys() == four[stem][stat].keys()
            for name in one[stem][stat]:
                torch.testing.assert_close(one[stem][stat][name], four[stem][stat][name], rtol=1e-5, atol=1e-6)


def test_lmdeploy_layout_keys(tiny_llama):
    model = _load(tiny_llama)
    exported = collect_stats(model, _ids(2, 8), "cpu", batch_size=2).export()
    assert set(exported) == {"inputs_stats", "outputs_stats", "key_stats", "value_stats"}
    assert set(exported["inputs_stats"]) == {"max", "min", "mean", "absmax", "absmean"}
    assert set(exported["key_stats"]) == {"max", "min", "absmax"}
    assert set(exported["key_stats"]["max"]) == {"model.layers.0", "model.layers.1"}
    assert set(exported["inputs_stats"]["mean"]) == {f"model.layers.{i}.{rel}" for i in range(2) for rel in LINEARS}
    assert "model.norm" in exported["outputs_stats"]["absmean"]
    assert exported["inputs_stats"]["max"]["model.layers.0.mlp.down_proj"].shape == (256,)
    assert exported["outputs_stats"]["max"]["model.layers.0.self_attn.k_proj"].shape == (64,)
    assert all(t.dtype == torch.float32 and t.device.type == "cpu"
               for stem in exported.values() for stat in stem.values() for t in stat.values())


def test_channel_observer_accumulates_exact_token_statistics():
    torch.manual_seed(0)
    parts = [torch.randn(2, 7, 5), torch.randn(1, 3, 5) * 4 - 1, torch.randn(4, 5)]
    obs = ChannelObserver(5)
    for part in parts:
        obs.observe(part)
    ref = _channel_reference(torch.cat([p.reshape(-1, 5) for p in parts]))
    got = obs.result()
    for stat, value in ref.items():
        torch.testing.assert_close(got[stat].double(), value, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        obs.observe(torch.zeros(3, 4))


def test_head_observer_per_head_and_dim():
    torch.manual_seed(0)
    parts = [torch.randn(2, 3, 6, 4), torch.randn(1, 3, 9, 4) * 3]
    obs = HeadObserver(3, 4)
    for part in parts:
        obs.observe(part)
    both = torch.cat([p.transpose(1, 2).reshape(-1, 3, 4) for p in parts])
    got = obs.result()
    assert torch.equal(got["max"], both.amax(0))
    assert torch.equal(got["min"], both.amin(0))
    assert torch.equal(got["absmax"], both.abs().amax(0))
    with pytest.raises(ValueError):
        obs.observe(torch.zeros(1, 6, 3, 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_layer_by_layer_matches_cpu_and_keeps_model_on_host(tiny_llama):
    model = _load(tiny_llama)
    input_ids = _ids(3, 32, seed=3)
    cpu = collect_stats(model, input_ids, "cpu", batch_size=2).export()
    gpu = collect_stats(model, input_ids, "cuda", batch_size=2).export()
    assert all(p.device.type == "cpu" for p in model.parameters())
    for stem in cpu:
        for stat in cpu[stem]:
            for name, value in cpu[stem][stat].items():
                assert gpu[stem][stat][name].device.type == "cpu"
                torch.testing.assert_close(gpu[stem][stat][name], value, rtol=1e-3, atol=1e-3)
