from __future__ import annotations

import pytest
import torch

from lmd.arch import decoder_layers
from lmd.lite.layerwise import base_model, capture_layer0_inputs, layer_on, run_layer
from tests.conftest import build_tiny_model


def _final_hidden_before_norm(model, input_ids: torch.Tensor) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    handle = base_model(model).norm.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    with torch.no_grad():
        model(input_ids)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize("model_type,attn", [("llama", "sdpa"), ("mistral", "sdpa"), ("qwen2", "sdpa"),
                                             ("qwen3", "sdpa"), ("llama", "eager")])
def test_layer_by_layer_matches_full_forward(tmp_path, model_type, attn):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / model_type, model_type)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (5, 24), generator=torch.Generator().manual_seed(0))
    expected = _final_hidden_before_norm(model, input_ids)

    inputs = capture_layer0_inputs(model, input_ids, "cpu", batch_size=2)
    assert [h.shape[0] for h in inputs.hidden] == [2, 2, 1]
    for layer in decoder_layers(model, model.config):
        with layer_on(layer, "cpu"):
            inputs = run_layer(layer, inputs, "cpu")
    assert inputs.num_samples == 5
    torch.testing.assert_close(inputs.cat(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layer_by_layer_on_cuda_keeps_model_on_host(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))
    expected = _final_hidden_before_norm(model, input_ids)
    inputs = capture_layer0_inputs(model, input_ids, "cuda", batch_size=2)
    assert all(p.device.type == "cpu" for p in model.parameters())
    for layer in decoder_layers(model, model.config):
        with layer_on(layer, "cuda"):
            inputs = run_layer(layer, inputs, "cuda")
        assert all(p.device.type == "cpu" for p in layer.parameters())
    torch.testing.assert_close(inputs.cat(), expected, rtol=1e-4, atol=1e-4)
