from __future__ import annotations

import pytest
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM

from lmd.arch import ARCHITECTURES, decoder_layers, get_arch, get_module, has_qkv_bias, rope_scaling, rope_theta
from lmd.errors import LmdError

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, pad_token_id=0)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_every_registered_arch_names_real_modules(model_type: str) -> None:
    config = AutoConfig.for_model(model_type, **TINY)
    model = AutoModelForCausalLM.from_config(config)
    spec = get_arch(config)
    for name in (spec.embed, spec.final_norm, spec.lm_head, spec.layers):
        assert isinstance(get_module(model, name), nn.Module)
    layer = decoder_layers(model, config)[0]
    for name in (spec.attn_norm, spec.mlp_norm, spec.attn, spec.mlp):
        assert isinstance(get_module(layer, name), nn.Module)
    for name in spec.linears:
        assert isinstance(get_module(layer, name), nn.Linear), name
    assert (get_module(layer, spec.qkv or spec.q).bias is not None) == has_qkv_bias(config)
    if spec.qk_norm:
        assert isinstance(get_module(layer, spec.q_norm), nn.Module) and isinstance(get_module(layer, spec.k_norm),
                                                                                     nn.Module)


def test_unsupported_arch_lists_supported() -> None:
    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2)
    with pytest.raises(LmdError, match="not supported; supported: internlm3, llama, mistral, phi3, qwen2, qwen3"):
        get_arch(config)


def test_rope_parameters_survive_both_config_generations() -> None:
    config = AutoConfig.for_model("llama", **TINY, rope_theta=100000.0)
    assert rope_theta(config) == 100000.0
    assert rope_scaling(config) == {}
    scaled = AutoConfig.for_model("llama", **TINY, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert rope_scaling(scaled)["rope_type"] == "linear"
    assert rope_scaling(scaled)["factor"] == 4.0
