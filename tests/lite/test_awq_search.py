"""Scale folding keeps the float model's function; the searched scales never lose to RTN on their own loss."""

from __future__ import annotations

import pytest
import torch

from lmd.arch import decoder_layers, get_arch
from lmd.lite.awq import scale_groups
from lmd.lite.awq_inputs import collect_block_inputs
from lmd.lite.awq_search import candidate_scales, fold_scales, search_scale, weight_mean
from lmd.lite.layerwise import capture_layer0_inputs
from tests.conftest import build_tiny_model


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def _ids(n: int = 4, length: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 49152, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type,kv_heads,expect_v_o", [("llama", 2, False), ("llama", 4, True),
                                                             ("qwen2", 2, False), ("mistral", 4, True),
                                                             ("qwen3", 2, False)])
def test_folding_random_scales_preserves_the_float_model(tmp_path, model_type, kv_heads, expect_v_o):
    model = _load(build_tiny_model(tmp_path / "m", model_type, num_key_value_heads=kv_heads))
    if model_type == "qwen2":  # make the qkv bias matter
        for layer in decoder_layers(model, model.config):
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
    arch = get_arch(model.config)
    inputs = capture_layer0_inputs(model, ids, "cpu", batch_size=2)
    generator = torch.Generator().manual_seed(1)
    for layer in decoder_layers(model, model.config):
        block = collect_block_inputs(layer, arch, inputs, "cpu", search_tokens=64, clip_tokens=16)
        groups = scale_groups(layer, arch, block)
        assert any(g.name == "v -> o" for g in groups) == expect_v_o
        for group in groups:
            scales = torch.rand(group.x_mean.shape[0], generator=generator) * 4 + 0.25
            fold_scales(group.prev, group.linears, scales)
        inputs = block.outputs
    with torch.no_grad():
        got = model(ids).logits
    assert (got - expected).norm() / expected.norm() < 1e-5


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_tied_gqa_v_o_scales_preserve_the_float_model_and_are_searched(tmp_path, model_type):
    model = _load(build_tiny_model(tmp_path / "m", model_type, num_key_value_heads=2))
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
    arch = get_arch(model.config)
    inputs = capture_layer0_inputs(model, ids, "cpu", batch_size=2)
    generator = torch.Generator().manual_seed(2)
    for layer in decoder_layers(model, model.config):
        block = collect_block_inputs(layer, arch, inputs, "cpu", search_tokens=64, clip_tokens=16)
        (group,) = [g for g in scale_groups(layer, arch, block, gqa_v_o=True) if g.name.startswith("v -> o")]
        v, o = group.prev, group.linears[0]
        tying = group.tying
        assert tying.kv_heads * tying.head_dim == v.out_features and tying.n_rep * v.out_features == o.in_features
        result = search_scale(group, 32, (False, True))
        assert result.loss <= result.rtn_loss
        assert torch.equal(tying.expand(result.prev_scales), result.scales)
        # query head h reads KV head h // n_rep: its o columns carry that KV head's scales
        per_head = result.scales.view(-1, tying.head_dim)
        for h in range(per_head.shape[0]):
            assert torch.equal(per_head[h], result.prev_scales.view(-1, tying.head_dim)[h // tying.n_rep])
        scales = torch.rand(v.out_features, generator=generator) * 4 + 0.25
        fold_scales(v, [o], tying.expand(scales), scales)
        inputs = block.outputs
    with torch.no_grad():
        got = model(ids).logits
    assert (got - expected).norm() / expected.norm() < 1e-5


def test_candidate_scales_are_normalised_and_alpha_zero_plain_is_identity():
    x_mean = torch.tensor([0.1, 1.0, 10.0, 3.0])
    w_mean = torch.tensor([0.5, 0.2, 0.9, 0.4])
    assert torch.allclose(candidate_scales(x_mean, w_mean, 0.0, duo=False), torch.ones(4))
    for duo in (False, True):
        s = candidate_scales(x_mean, w_mean, 0.5, duo)
        assert torch.isclose(s.max() * s.min(), torch.tensor(1.0))
    plain = candidate_scales(x_mean, w_mean, 0.5, duo=False)
    assert torch.allclose(plain / plain[1], (x_mean / x_mean[1]).sqrt())


def test_weight_mean_is_relative_to_the_group_absmax():
    lin = torch.nn.Linear(4, 2, bias=False)
    lin.weight.data = torch.tensor([[1.0, -2.0, 0.5, 4.0], [2.0, 2.0, -1.0, 1.0]])
    # groups of 2 along each row: row0 (1,-2)->(.5,1) (.5,4)->(.125,1); row1 (2,2)->(1,1) (-1,1)->(1,1)
    assert torch.allclose(weight_mean([lin], 2), torch.tensor([0.75, 1.0, 0.5625, 1.0]), atol=1e-5)


def test_search_never_loses_to_rtn_and_restores_weights(tiny_llama):
    model = _load(tiny_llama)
    arch = get_arch(model.config)
    layer = decoder_layers(model, model.config)[0]
    inputs = capture_layer0_inputs(model, _ids(), "cpu", batch_size=4)
    block = collect_block_inputs(layer, arch, inputs, "cpu", search_tokens=0, clip_tokens=16)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    for group in scale_groups(layer, arch, block):
        result = search_scale(group, 32, (False, True))
        assert result.loss <= result.rtn_loss
        assert 0.0 <= result.alpha < 1.0 and result.scales.shape == group.x_mean.shape
    for name, tensor in layer.state_dict().items():
        assert torch.equal(tensor, before[name]), name
