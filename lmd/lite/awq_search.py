"""AWQ's activation-aware scale search for one scale group, and folding the chosen scales into the model.

A scale group is a module `prev` (a norm or a linear) whose output feeds `linears`. Multiplying the linears' input
channels by s and dividing prev's output channels by s leaves the float model unchanged, but moves quantization error
away from the channels with large activations. For each candidate s the linears are fake-quantized as Q(W·s)/s and the
module being inspected (attention, MLP or a single linear) is re-run on calibration inputs; the s with the lowest
output MSE against the float output wins.

Candidates (llm-awq / AutoAWQ): alpha in {0, 1/20, ..., 19/20} and
    s = x_mean^alpha                                  (plain)
    s = x_mean^alpha / w_mean^(1 - alpha)             (duo scaling)
normalised by sqrt(max(s) · min(s)). x_mean is the mean |x| per input channel over all calibration tokens; w_mean is
the mean over output rows of |w| divided by its group's absmax. Plain alpha = 0 is s = 1, i.e. plain round-to-nearest,
so the search never does worse than RTN on its own loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from lmd.lite.quantizer import fake_quantize

N_GRID = 20


@dataclass(frozen=True)
class HeadTying:
    """v -> o under GQA: query head h reads KV head h // n_rep, so dividing v's output channel (kv, d) by s multiplies
    o's input channels (h, d) of all n_rep query heads of that KV head by s. One scale per v channel, shared by them.

        o input channel  h * head_dim + d   <->   v output channel  (h // n_rep) * head_dim + d
    """

    kv_heads: int
    n_rep: int
    head_dim: int

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """[kv_heads * n_rep * head_dim] (o's inputs) -> [kv_heads * head_dim], the mean over each KV head's group."""
        return t.view(self.kv_heads, self.n_rep, self.head_dim).mean(dim=1).reshape(-1)

    def expand(self, t: torch.Tensor) -> torch.Tensor:
        """[kv_heads * head_dim] (v's outputs) -> [kv_heads * n_rep * head_dim]."""
        return t.view(self.kv_heads, 1, self.head_dim).expand(-1, self.n_rep, -1).reshape(-1)


@dataclass
class ScaleGroup:
    name: str  # for reports, e.g. "input_layernorm -> q,k,v"
    prev: nn.Module  # norm (weight, optional bias) or nn.Linear whose output channels feed `linears`
    linears: list[nn.Linear]
    consumer: str  # which cached input the linears read (it is divided by the chosen scales once they are folded)
    x_mean: torch.Tensor  # [in] mean |x| over all calibration tokens
    inspect: Callable[[], torch.Tensor]  # re-runs the inspected module on the search inputs with the current weights
    tying: HeadTying | None = None  # prev has fewer output channels than the linears have inputs (GQA v -> o)


@dataclass(frozen=True)
class ScaleResult:
    name: str
    scales: torch.Tensor  # [in] of the linears, float32
    prev_scales: torch.Tensor  # [out] of prev: the same as `scales` unless the group is tied
    alpha: float
    duo: bool
    loss: float
    rtn_loss: float  # the loss of s = 1 (plain round-to-nearest) on the same inputs


def weight_mean(linears: Sequence[nn.Linear], group_size: int) -> torch.Tensor:
    """Per input channel: mean over all output rows of |w| / absmax(|w| in its quantization group)."""
    weight = torch.cat([lin.weight.detach().to(torch.float32) for lin in linears], dim=0)
    grouped = weight.abs().view(-1, group_size)
    relative = grouped / (grouped.amax(dim=1, keepdim=True) + 1e-6)
    return relative.view(weight.shape).mean(dim=0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, alpha: float, duo: bool) -> torch.Tensor:
    if duo:
        scales = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
    else:
        scales = x_mean.pow(alpha).clamp(min=1e-4)
    scales = scales / (scales.max() * scales.min()).sqrt()
    scales[torch.isinf(scales) | torch.isnan(scales)] = 1.0
    return scales


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(torch.float32) - b.to(torch.float32)).pow(2).mean())


@torch.no_grad()
def search_scale(group: ScaleGroup, group_size: int, duo_modes: Sequence[bool]) -> ScaleResult:
    """Try every candidate of every mode in `duo_modes`; the group's weights are restored before returning."""
    originals = [lin.weight.detach().clone() for lin in group.linears]
    x_mean = group.x_mean.to(torch.float32).to(originals[0].device)
    w_mean = weight_mean(group.linears, group_size)
    tying = group.tying
    if tying is not None:  # candidates live on prev's channels; the linears see them expanded
        x_mean, w_mean = tying.reduce(x_mean), tying.reduce(w_mean)
    reference = group.inspect()

    def loss_with(scales: torch.Tensor) -> float:
        if tying is not None:
            scales = tying.expand(scales)
        for lin, weight in zip(group.linears, originals, strict=True):
            s = scales.to(weight.dtype).view(1, -1)
            lin.weight.data = fake_quantize(weight * s, group_size) / s
        return _mse(group.inspect(), reference)

    try:
        ones = torch.ones_like(x_mean)
        rtn_loss = loss_with(ones)
        best = (rtn_loss, ones, 0.0, False)
        for duo in duo_modes:
            for step in range(N_GRID):
                alpha = step / N_GRID
                if step == 0 and not duo:
                    continue  # s = 1: the RTN loss measured above
                scales = candidate_scales(x_mean, w_mean, alpha, duo)
                loss = loss_with(scales)
                if loss < best[0]:
                    best = (loss, scales, alpha, duo)
    finally:
        for lin, weight in zip(group.linears, originals, strict=True):
            lin.weight.data = weight
    loss, scales, alpha, duo = best
    expanded = scales if tying is None else tying.expand(scales)
    return ScaleResult(group.name, expanded.detach().clone(), scales.detach().clone(), alpha, duo, loss, rtn_loss)


@torch.no_grad()
def fold_scales(prev: nn.Module, linears: Sequence[nn.Linear], scales: torch.Tensor,
                prev_scales: torch.Tensor | None = None) -> None:
    """prev's output channels / s, the linears' input channels * s: the float function is unchanged. `prev_scales`
    (default: `scales`) is s on prev's channels when a tied group expands them (HeadTying)."""
    s = (scales if prev_scales is None else prev_scales).to(torch.float32)
    if isinstance(prev, nn.Linear):
        prev.weight.data = (prev.weight.to(torch.float32) / s.view(-1, 1)).to(prev.weight.dtype)
    else:
        prev.weight.data = (prev.weight.to(torch.float32) / s).to(prev.weight.dtype)
    bias = getattr(prev, "bias", None)
    if bias is not None:
        bias.data = (bias.to(torch.float32) / s).to(bias.dtype)
    s = scales.to(torch.float32)
    for lin in linears:
        lin.weight.data = (lin.weight.to(torch.float32) * s.view(1, -1)).to(lin.weight.dtype)
