"""AutoRound-style signed-gradient rounding: the learned block beats round-to-nearest on the block's own output,
on held-out sequences, and its codes are an ordinary per-group int4 grid."""

from __future__ import annotations

import pytest
import torch

from lmd.arch import decoder_layers, get_arch
from lmd.lite.autoround import SignRoundConfig, _LearnedGrid, sign_round_block
from lmd.lite.layerwise import capture_layer0_inputs, run_layer
from lmd.lite.quantizer import quantize_weight


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _block_error(layer, arch, weights: dict, inputs, targets) -> float:
    for path, w in weights.items():
        layer.get_submodule(path).weight.data = w
    out = run_layer(layer, inputs, "cpu")
    return float(sum((o - t).pow(2).sum() for o, t in zip(out.hidden, targets.hidden, strict=True)))


@pytest.mark.parametrize("group_size", [32, 64])
def test_learned_rounding_beats_rtn_on_held_out_block_outputs(group_size):
    model = _tiny_llama()
    arch = get_arch(model.config)
    layer = decoder_layers(model, model.config)[0]
    ids = torch.randint(0, 256, (72, 32), generator=torch.Generator().manual_seed(1))
    train = capture_layer0_inputs(model, ids[:64], "cpu", 16)
    held = capture_layer0_inputs(model, ids[64:], "cpu", 8)
    float_weights = {p: layer.get_submodule(p).weight.detach().clone() for p in arch.linears}
    train_targets, held_targets = run_layer(layer, train, "cpu"), run_layer(layer, held, "cpu")
    learned = sign_round_block(layer, arch.linears, group_size, train, train_targets,
                               SignRoundConfig(iters=60, batch=16, held_out=2))
    assert all(torch.equal(layer.get_submodule(p).weight, w) for p, w in float_weights.items())  # left untouched
    rtn = {p: quantize_weight(w, group_size).dequantize() for p, w in float_weights.items()}
    ours = {p: q.dequantize() for p, q in learned.items()}
    rtn_error = _block_error(layer, arch, rtn, held, held_targets)
    our_error = _block_error(layer, arch, ours, held, held_targets)
    # learned/rtn on the held-out sequences, model seeds 0..2: 0.72..0.90 at g32, 0.60..0.76 at g64 (seed 0: 0.74,
    # 0.60); 1.0 when nothing is learned (the held-out guard falls back to RTN)
    assert our_error < 0.9 * rtn_error, (our_error, rtn_error)
    for q in learned.values():
        assert q.codes.max() <= 15 and q.zeros.max() <= 15 and q.scales.dtype == torch.float16


def test_the_starting_point_is_round_to_nearest():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    grid = _LearnedGrid(w, 32)
    rtn = quantize_weight(w, 32)
    q = grid.quantized()
    assert torch.equal(q.codes, rtn.codes) and torch.equal(q.zeros, rtn.zeros) and torch.equal(q.scales, rtn.scales)
    assert torch.equal(grid.fake_weight(), rtn.dequantize())  # what training sees is what is exported
