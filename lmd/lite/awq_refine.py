"""Activation-aware refinement of each (row, group)'s int4 grid after the clip search (an lmd extension of AWQ).

Min-max (after clipping) fixes scale = (max - min) / 15 and zero = round(-min / scale) without looking at the inputs.
With H the group's Gram matrix of the inputs (mean x x^T over calibration tokens), the output error of a weight change
d is d^T H d (as in the clip search). Alternating, per (row, group):

    codes = clamp(round(w / s) + z, 0, 15),  c = codes - z
    s     = argmin_s (w - s c)^T H (w - s c) = c^T H w / c^T H c          (closed form, rounded to fp16)
    z     = the integer 0..15 that minimises the error of clamp(round(w / s) + z) - z at that s

Every iterate is scored against the float weights and the best one is kept, the starting grid included, so the error
of a (row, group) never increases. The format is unchanged: fp16 scales, integer zero points 0..15.
"""

from __future__ import annotations

import torch

from lmd.lite.awq_clip import group_error
from lmd.lite.quantizer import MAX_CODE, SCALE_DTYPE, QuantizedWeight

REFINE_ITERS = 4
MIN_SCALE = 1e-5


def group_grams(hessian: torch.Tensor, group_size: int) -> torch.Tensor:
    """The diagonal [g, g] blocks of an [in, in] Gram matrix -> [in // g, g, g]."""
    groups = hessian.shape[0] // group_size
    blocks = hessian.to(torch.float32).view(groups, group_size, groups, group_size)
    return torch.diagonal(blocks, dim1=0, dim2=2).permute(2, 0, 1).contiguous()


def _codes(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(w / s) + z, 0, MAX_CODE)


def _best_zero(w: torch.Tensor, s: torch.Tensor, gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For scale s [G, out, 1]: the zero point 0..15 with the lowest error, and that error."""
    best_err = torch.full(w.shape[:2], float("inf"), device=w.device)
    best_z = torch.zeros_like(s)
    for zero in range(MAX_CODE + 1):
        z = torch.full_like(s, float(zero))
        err = group_error((_codes(w, s, z) - z) * s - w, gram)
        better = (err < best_err).unsqueeze(-1)
        best_err = torch.where(better.squeeze(-1), err, best_err)
        best_z = torch.where(better, z, best_z)
    return best_z, best_err


@torch.no_grad()
def refine_grid(
    weight: torch.Tensor, start: QuantizedWeight, gram: torch.Tensor, iters: int = REFINE_ITERS
) -> QuantizedWeight:
    """weight [out, in]: the float weights to approximate (before clipping); start: their min-max/clip quantization;
    gram [in // g, g, g]: each group's input Gram matrix. Returns a quantization whose d^T H d is at most start's in
    every (row, group)."""
    out, inp = weight.shape
    g = start.group_size
    groups = inp // g

    def by_group(t: torch.Tensor) -> torch.Tensor:  # [out, G * k] -> [G, out, k]
        return t.to(torch.float32).reshape(out, groups, -1).transpose(0, 1)

    w = by_group(weight)
    gram = gram.to(torch.float32).to(w.device)
    s, z = by_group(start.scales), by_group(start.zeros)
    best_s, best_z, best_codes = s, z, by_group(start.codes)
    best_err = group_error((best_codes - z) * s - w, gram)
    for _ in range(iters):
        c = _codes(w, s, z) - z
        hc = torch.bmm(c, gram)
        num, den = (hc * w).sum(-1, keepdim=True), (hc * c).sum(-1, keepdim=True)
        fitted = torch.where(den > 0, num / den.clamp(min=1e-30), s)
        s = torch.where(fitted > MIN_SCALE, fitted, s).to(SCALE_DTYPE).to(torch.float32)
        z, err = _best_zero(w, s, gram)
        better = err < best_err
        keep = better.unsqueeze(-1)
        best_err = torch.where(better, err, best_err)
        best_s, best_z = torch.where(keep, s, best_s), torch.where(keep, z, best_z)
        best_codes = torch.where(keep, _codes(w, s, z), best_codes)

    def by_row(t: torch.Tensor) -> torch.Tensor:  # [G, out, k] -> [out, G * k]
        return t.transpose(0, 1).reshape(out, -1)

    return QuantizedWeight(
        codes=by_row(best_codes).to(torch.uint8),
        zeros=by_row(best_z).to(torch.uint8),
        scales=by_row(best_s).to(SCALE_DTYPE),
        group_size=g,
    )
