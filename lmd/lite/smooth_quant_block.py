"""`--smooth-alpha block`: SmoothQuant's α chosen per smoothing group by the error of the whole decoder layer's output
under fake W8A8, layer by layer (AutoSmoothQuant / OmniQuant's objective, without their learned parameters).

For layer i, with X its inputs on the calibration windows and Y = layer(X) in float:
    for each group g in (attention norm, v -> o, MLP norm, up -> down), the others held at their current α:
        α_g = argmin over the grid of ||W8A8(smoothed layer)(X) − Y||²
The layer is then smoothed with the chosen αs (exact in float). X is the float model's own hidden state: smoothing
leaves the float function unchanged, so the float chain is valid whatever earlier layers chose. The per-linear
objective (`--smooth-alpha auto`) misses that errors of q/k/v, o, gate/up and down interact through attention, the
SiLU gate and the residual; judged on the block output, a group's α is charged for what reaches the next layer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from lmd.arch import ArchSpec, decoder_layers, get_module
from lmd.turbomind.kernels.w8a8_reference import quantize_per_token_reference, quantize_weight_per_channel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from lmd.lite.layerwise import LayerInputs
    from lmd.lite.smooth_quant import SmoothGroup

BLOCK_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
START_ALPHA = 0.5


@contextmanager
def fake_w8a8(layer: torch.nn.Module, arch: ArchSpec, qdtype: torch.dtype,
              keep: Collection[str] = ()) -> Iterator[None]:
    """Within the block, `layer`'s linears (ArchSpec names, all but `keep`) compute Q(x) · Q(W)ᵀ: weights per output
    channel, inputs per token, as the engine's W8A8Linear. The float weights are restored on exit."""
    saved, hooks = {}, []

    def quantize_input(_m, args):
        x = args[0]
        codes, scale = quantize_per_token_reference(x.reshape(-1, x.shape[-1]), qdtype)
        return ((codes.float() * scale[:, None]).reshape(x.shape).to(x.dtype),)

    try:
        with torch.no_grad():
            for name in arch.linears:
                if name in keep:
                    continue
                module = get_module(layer, name)
                saved[name] = module.weight.detach().clone()
                q, s = quantize_weight_per_channel(module.weight, qdtype)
                module.weight.copy_((q.float() * s[:, None]).to(module.weight.dtype))
                hooks.append(module.register_forward_pre_hook(quantize_input))
        yield
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for name, weight in saved.items():
                get_module(layer, name).weight.copy_(weight)


def block_error(layer: torch.nn.Module, arch: ArchSpec, inputs: LayerInputs, reference: list[torch.Tensor],
                qdtype: torch.dtype, keep: Collection[str] = ()) -> float:
    """||W8A8(layer)(X) − Y||² summed over the calibration chunks."""
    from lmd.lite.layerwise import run_layer

    with fake_w8a8(layer, arch, qdtype, keep):
        out = run_layer(layer, inputs, "cpu").hidden
    return float(sum((o.float() - r.float()).pow(2).sum() for o, r in zip(out, reference, strict=True)))


@torch.no_grad()
def block_search_smooth(model: PreTrainedModel, arch: ArchSpec, input_absmax: dict[str, torch.Tensor],
                        input_ids: torch.Tensor, qdtype: torch.dtype, grid: tuple[float, ...] = BLOCK_GRID,
                        keep: dict[int, Collection[str]] | None = None) -> list[float]:
    """Smooth every decoder layer in place with αs searched on its block output; returns them (4 per layer).
    `keep`: per layer index, the linears left in 16 bits (not fake-quantized while judging)."""
    from lmd.lite.layerwise import capture_layer0_inputs, run_layer
    from lmd.lite.smooth_quant import layer_groups, smooth_layer

    inputs = capture_layer0_inputs(model, input_ids, "cpu", batch_size=input_ids.shape[0])
    chosen: list[float] = []
    for i, layer in enumerate(decoder_layers(model, model.config)):
        reference = run_layer(layer, inputs, "cpu")
        prefix = f"{arch.layers}.{i}."
        alphas = search_layer(layer, lambda m, p=prefix: layer_groups(m, model.config, arch, input_absmax, p), arch,
                              inputs, reference.hidden, qdtype, grid, (keep or {}).get(i, ()))
        smooth_layer(layer_groups(layer, model.config, arch, input_absmax, prefix), alphas)
        chosen.extend(alphas)
        inputs = reference
    return chosen


def search_layer(layer: torch.nn.Module, groups_of: Callable[[torch.nn.Module], list[SmoothGroup]], arch: ArchSpec,
                 inputs: LayerInputs, reference: list[torch.Tensor], qdtype: torch.dtype, grid: tuple[float, ...],
                 keep: Collection[str]) -> list[float]:
    """One pass of coordinate descent over the 4 groups' αs (from START_ALPHA) on the layer's block error."""
    from lmd.lite.smooth_quant import smooth_layer

    def error(alphas: list[float]) -> float:
        trial = copy.deepcopy(layer)
        smooth_layer(groups_of(trial), alphas)
        return block_error(trial, arch, inputs, reference, qdtype, keep)

    alphas = [START_ALPHA] * 4
    for g in (0, 2, 1, 3):  # attention norm, v -> o, MLP norm, up -> down: the order data flows
        alphas[g] = min(grid, key=lambda a, g=g: error(alphas[:g] + [a] + alphas[g + 1:]))
    return alphas
