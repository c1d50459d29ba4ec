"""AWQ's weight clipping search: per (output row, group), shrink the weight range to minimise the output error.

For every candidate max = absmax · (1 − i/20), i = 0..9 (10 shrink steps of 5 %, down to 55 % of the range), the weight
is clamped to [−max, max] and fake-quantized; the error is the mean over sampled tokens of the squared difference of
that group's partial dot product, x_group · w_group, against the float one. Each (row, group) keeps its best max.
Query and key projections are not clipped (their errors are amplified by the softmax; AutoAWQ skips them too).

`search_clip_asymmetric` (lmd's `--asym-clip`, beyond AWQ) shrinks the top and the bottom of the range separately:
[min · (1 − j/20), max · (1 − i/20)] for every pair i, j = 0..9 (the symmetric candidates' 10 steps on each side),
plus the 10 symmetric candidates themselves, all scored the same way: no (row, group) gets a larger error than with
the symmetric search or unclipped.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lmd.lite.quantizer import fake_quantize_groups

N_GRID = 20
SHRINK_STEPS = 10  # max_shrink 0.5 at N_GRID 20


@torch.no_grad()
def search_clip(weight: torch.Tensor, x: torch.Tensor, group_size: int) -> torch.Tensor:
    """weight [out, in], x [tokens, in] (the linear's sampled inputs) -> best max |w| per (row, group) [out, G].

    The error of a weight change d in one group is mean_t (x_t · d)^2 = d^T H d with H = mean_t x_t x_t^T, the
    group's [g, g] Gram matrix: exact, and far cheaper than re-running the tokens for every candidate.
    """
    w, gram = _by_group(weight, x, group_size)
    _, high = _best_range(w, gram, _symmetric(w))
    return high.transpose(0, 1).contiguous()


@torch.no_grad()
def search_clip_asymmetric(weight: torch.Tensor, x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in], x [tokens, in] -> the best (low, high) limits per (row, group), each [out, G]."""
    w, gram = _by_group(weight, x, group_size)
    wmax, wmin = w.amax(dim=-1, keepdim=True), w.amin(dim=-1, keepdim=True)  # [G, out, 1]
    pairs = [
        (torch.minimum(wmin * (1 - bottom / N_GRID), wmax * (1 - top / N_GRID)), wmax * (1 - top / N_GRID))
        for top in range(SHRINK_STEPS)
        for bottom in range(SHRINK_STEPS)
    ]
    low, high = _best_range(w, gram, _symmetric(w) + pairs)
    return low.transpose(0, 1).contiguous(), high.transpose(0, 1).contiguous()


def group_error(delta: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """delta [G, out, g] (quantized - float weights), gram [G, g, g] -> d^T H d per (group, row) [G, out]."""
    return (torch.bmm(delta, gram) * delta).sum(dim=-1)


def _symmetric(w: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """AWQ's candidates: [-m, m] with m = absmax · (1 - i/20), i = 0..9, each [G, out, 1]."""
    absmax = w.abs().amax(dim=-1, keepdim=True)
    return [(-absmax * (1 - i / N_GRID), absmax * (1 - i / N_GRID)) for i in range(SHRINK_STEPS)]


def _best_range(w: torch.Tensor, gram: torch.Tensor, candidates: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (low, high) [G, out] of the candidate with the lowest error per (group, row); the first wins ties."""
    min_err = best_lo = best_hi = None
    for lo, hi in candidates:
        err = group_error(fake_quantize_groups(torch.clamp(w, lo, hi)) - w, gram)
        lo, hi = lo.squeeze(-1), hi.squeeze(-1)
        if min_err is None:
            min_err, best_lo, best_hi = err, lo, hi
            continue
        better = err < min_err
        min_err = torch.where(better, err, min_err)
        best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
    return best_lo, best_hi


def _by_group(weight: torch.Tensor, x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in], x [tokens, in] -> weight [G, out, g] and each group's Gram matrix mean x x^T [G, g, g]."""
    out, inp = weight.shape
    groups = inp // group_size
    xg = x.to(torch.float32).reshape(-1, groups, group_size).transpose(0, 1)  # [G, T, g]
    gram = torch.bmm(xg.transpose(1, 2), xg) / xg.shape[1]
    return weight.to(torch.float32).reshape(out, groups, group_size).transpose(0, 1), gram


@torch.no_grad()
def apply_clip_range(linear: nn.Linear, low: torch.Tensor, high: torch.Tensor, group_size: int) -> None:
    """Clamp each (row, group) of the weight to [low, high] (each [out, G])."""
    out, inp = linear.weight.shape
    lo, hi = (t.to(linear.weight.device).unsqueeze(-1) for t in (low, high))
    w = linear.weight.to(torch.float32).reshape(out, inp // group_size, group_size)
    linear.weight.data = torch.clamp(w, lo, hi).reshape(out, inp).to(linear.weight.dtype)


@torch.no_grad()
def apply_clip(linear: nn.Linear, max_val: torch.Tensor, group_size: int) -> None:
    apply_clip_range(linear, -max_val, max_val, group_size)
