"""`--smooth-alpha auto`: SmoothQuant's α chosen per smoothing group from a grid, by the W8A8 error of that group's
output on calibration activations.

Each group's choice is local: a norm -> linears group changes only those linears' inputs; v -> o and up -> down
scale v's and up's output rows, which their per-output-channel weight quantization absorbs, so only o's and down's
error moves. And smoothing is exact in float, so activations captured from the float model stay valid for every
layer whatever was chosen before it. The error of a group for α is ||Q(x / s) · Q(W · s)ᵀ − x · Wᵀ||² over the
captured tokens (Q: per-token / per-channel fake quantization).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lmd.arch import ArchSpec, decoder_layers, get_module
from lmd.turbomind.kernels.w8a8_reference import quantize_per_token_reference, quantize_weight_per_channel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

GRID = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
SEARCHED_INPUTS = ("q", "gate", "o", "down")  # ArchSpec fields: the first linear of each smoothing group
TOKENS_KEPT = 2048  # captured input rows per linear (a random subset of the calibration tokens)


@torch.no_grad()
def capture_inputs(model: PreTrainedModel, arch: ArchSpec, input_ids: torch.Tensor,
                   modules: tuple[str, ...], seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs [T, K] of the named linears of every decoder layer over the calibration windows (rows subsampled)."""
    rows: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(decoder_layers(model, model.config)):
        for name in modules:
            key = f"{arch.layers}.{i}.{name}"

            def hook(_m, args, key=key):
                rows.setdefault(key, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu())

            hooks.append(get_module(layer, name).register_forward_pre_hook(hook))
    try:
        for window in input_ids:
            model(window[None])
    finally:
        for h in hooks:
            h.remove()
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for key, parts in rows.items():
        x = torch.cat(parts)
        keep = torch.randperm(x.shape[0], generator=generator)[:TOKENS_KEPT]
        out[key] = x[keep]
    return out


def group_error(x: torch.Tensor, weight: torch.Tensor, s: torch.Tensor, qdtype: torch.dtype,
                reference: torch.Tensor | None = None) -> float:
    """||Q(x / s) Q(W s)ᵀ − x Wᵀ||² for x [T, K], W [N, K], s [K] (`reference`: x Wᵀ, when already computed)."""
    ref = x @ weight.float().t() if reference is None else reference
    q, qs = quantize_per_token_reference(x / s, qdtype)
    wq, ws = quantize_weight_per_channel(weight.float() * s, qdtype)
    approx = (q.float() * qs[:, None]) @ (wq.float() * ws[:, None]).t()
    return float((approx - ref).pow(2).sum())


def best_alpha(x: torch.Tensor, weight: torch.Tensor, scales_for: Callable[[float], torch.Tensor],
               qdtype: torch.dtype, grid: tuple[float, ...] = GRID) -> float:
    """The α of `grid` whose smoothing scales (`scales_for(α)`, [K]) give the least group_error."""
    reference = x @ weight.float().t()
    return min(grid, key=lambda a: group_error(x, weight, scales_for(a), qdtype, reference))
