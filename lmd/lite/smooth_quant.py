"""SmoothQuant (Xiao et al.; LMDeploy lite's `smooth_quant`): move activation outliers into the weights.

For a linear fed by x, per input channel j: s_j = max|x_j|^α / max|W_:,j|^(1-α); x_j / s_j and W_:,j · s_j give the
same product with a flatter activation, which per-token int8 then resolves. The division is folded into whatever
produces x, so the float model is unchanged (up to rounding):

    attention norm -> q, k, v     norm weight / s        q/k/v columns · s
    mlp norm       -> gate, up    norm weight / s        gate/up columns · s
    v              -> o           v rows (and bias) / s  o columns · s   (s shared by the query heads of a KV head)
    up             -> down        up rows / s            down columns · s (silu(gate) · up is linear in up)

max|x_j| comes from `lmd calibrate`'s inputs_stats.pth (absmax per input channel of every linear, float model).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lmd.arch import ArchSpec, decoder_layers, get_module
from lmd.errors import LmdError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MIN_SCALE = 1e-5


def smooth_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [K] for linears [N_i, K] sharing one input whose per-channel absmax is act_absmax [K]."""
    w_absmax = torch.cat([w.abs().float() for w in weights]).amax(dim=0).clamp(min=MIN_SCALE)
    a = act_absmax.float().clamp(min=MIN_SCALE)
    return (a.pow(alpha) / w_absmax.pow(1 - alpha)).clamp(min=MIN_SCALE)


@torch.no_grad()
def smooth_model(model: PreTrainedModel, arch: ArchSpec, input_absmax: dict[str, torch.Tensor], alpha: float | None,
                 inputs: dict[str, torch.Tensor] | None = None, qdtype: torch.dtype = torch.int8) -> list[float]:
    """Smooth every decoder layer in place; returns the α of each smoothing group (4 per layer, in the order of the
    module docstring). alpha None: each group's α is searched (lmd.lite.smooth_quant_search) on `inputs`, the
    captured inputs of q_proj, gate_proj, o_proj and down_proj."""
    from lmd.lite.smooth_quant_search import best_alpha

    chosen: list[float] = []
    for i, layer in enumerate(decoder_layers(model, model.config)):
        prefix = f"{arch.layers}.{i}."
        groups = layer_groups(layer, model.config, arch, input_absmax, prefix)
        for group in groups:
            if alpha is None:
                assert inputs is not None
                chosen.append(best_alpha(inputs[prefix + group.input], group.weight, group.scales, qdtype))
            else:
                chosen.append(alpha)
        smooth_layer(groups, chosen[-len(groups):])
    return chosen


@dataclass(frozen=True)
class SmoothGroup:
    """One smoothing group of a layer: `scales(α)` [K] for the linear input `input` (a module of the layer) and
    `apply(s)` folding them in; `weight` is the group's linears' weights concatenated [N, K] (the search's view)."""

    input: str
    weight: torch.Tensor
    scales: Callable[[float], torch.Tensor]
    apply: Callable[[torch.Tensor], None]


def layer_groups(layer: torch.nn.Module, config, arch: ArchSpec, input_absmax: dict[str, torch.Tensor],
                 prefix: str) -> list[SmoothGroup]:
    """The 4 smoothing groups of one decoder layer (attention norm, MLP norm, v -> o, up -> down)."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    rep = heads // kv_heads

    def stats(module: str, width: int) -> torch.Tensor:
        name = prefix + module
        if name not in input_absmax:
            raise LmdError(f"inputs_stats.pth has no {name}; it was calibrated on another model, re-run "
                           "`lmd calibrate` on this one")
        value = input_absmax[name]
        if value.shape != (width,):
            raise LmdError(f"inputs_stats.pth: {name} has {tuple(value.shape)} channels, the model {width}; "
                           "re-run `lmd calibrate` on this model")
        return value

    q, k, v, o = (get_module(layer, m) for m in (arch.q, arch.k, arch.v, arch.o))
    gate, up, down = (get_module(layer, m) for m in (arch.gate, arch.up, arch.down))
    hidden = q.weight.shape[1]
    groups = []
    for norm, linears, first in ((arch.attn_norm, [q, k, v], arch.q), (arch.mlp_norm, [gate, up], arch.gate)):
        weights = [lin.weight for lin in linears]
        groups.append(SmoothGroup(first, torch.cat(weights), functools.partial(smooth_scales, stats(first, hidden),
                                                                                weights),
                                  functools.partial(_norm_to_linears, get_module(layer, norm), linears)))
    v_scales = functools.partial(_v_to_o_scales, o.weight, stats(arch.o, heads * head_dim), kv_heads, rep, head_dim)

    def v_to_o(s: torch.Tensor) -> None:  # s [Hq * D], equal across the query heads of a KV head
        _rows_divided(v, _first_of_heads(s, kv_heads, rep))
        o.weight.mul_(s.to(o.weight.dtype))

    groups.append(SmoothGroup(arch.o, o.weight, lambda a: _repeat_heads(v_scales(a), kv_heads, rep), v_to_o))

    def up_to_down(s: torch.Tensor) -> None:
        _rows_divided(up, s)
        down.weight.mul_(s.to(down.weight.dtype))

    groups.append(SmoothGroup(arch.down, down.weight,
                              functools.partial(smooth_scales, stats(arch.down, down.weight.shape[1]), [down.weight]),
                              up_to_down))
    return groups


@torch.no_grad()
def smooth_layer(groups: list[SmoothGroup], alphas: list[float]) -> None:
    """Fold each group's scales for its α into the layer. Scales are all computed first: a group's weights must
    be read before any other group rescales them (v -> o reads o, which no other group touches; kept general)."""
    scales = [g.scales(a) for g, a in zip(groups, alphas, strict=True)]
    for group, s in zip(groups, scales, strict=True):
        group.apply(s)


def _norm_to_linears(norm: torch.nn.Module, linears: list[torch.nn.Module], s: torch.Tensor) -> None:
    norm.weight.div_(s.to(norm.weight.dtype))
    for lin in linears:
        lin.weight.mul_(s.to(lin.weight.dtype))


def _v_to_o_scales(o_weight: torch.Tensor, act: torch.Tensor, kv_heads: int, rep: int, head_dim: int,
                   alpha: float) -> torch.Tensor:
    """One scale per v output channel: o's input channel (h, d) is v's channel (h // rep, d), so the scale is taken
    over its rep query heads (their largest activation and weight)."""
    a = act.float().reshape(kv_heads, rep, head_dim).amax(dim=1).reshape(-1)
    w = o_weight.abs().float().reshape(o_weight.shape[0], kv_heads, rep, head_dim).amax(dim=(0, 2)).reshape(1, -1)
    return smooth_scales(a, [w], alpha)


def _first_of_heads(s: torch.Tensor, kv_heads: int, rep: int) -> torch.Tensor:
    """[Hq * D] per o input channel (equal across a KV head's query heads) -> [Hkv * D] per v channel."""
    return s.reshape(kv_heads, rep, -1)[:, 0].reshape(-1)


def _repeat_heads(s: torch.Tensor, kv_heads: int, rep: int) -> torch.Tensor:
    """[Hkv * D] per v channel -> [Hq * D] per o input channel."""
    return s.reshape(kv_heads, 1, -1).expand(kv_heads, rep, s.numel() // kv_heads).reshape(-1)


def _rows_divided(linear: torch.nn.Module, s: torch.Tensor) -> None:
    linear.weight.div_(s.to(linear.weight.dtype)[:, None])
    if getattr(linear, "bias", None) is not None:
        linear.bias.div_(s.to(linear.bias.dtype))
