"""The last step of AWQ for one linear: from its scaled (and clipped) weight to int4 codes on a per-group grid.

    grid   = min-max of the clipped weight (AWQ: the codes are round-to-nearest on it)
    refine = the grid refined against the input Gram matrix (--refine-scale, awq_refine)
    gptq   = codes chosen with GPTQ's error feedback on that grid (--gptq, gptq)
Refinement and GPTQ target the scaled weight *before* clipping (the float function), as the clip search does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmd.lite.awq_refine import group_grams, refine_grid
from lmd.lite.gptq import gptq_quantize
from lmd.lite.quantizer import QuantizedWeight, quantize_weight


@dataclass(frozen=True)
class Rounding:
    refine: bool = False
    gptq: bool = False

    @property
    def needs_hessian(self) -> bool:
        return self.refine or self.gptq


def round_linear(
    target: torch.Tensor, clipped: torch.Tensor, group_size: int, rounding: Rounding, hessian: torch.Tensor | None = None
) -> QuantizedWeight:
    """target: the float weight [out, in] the codes should reproduce; clipped: the same after clipping (or target);
    hessian: mean x x^T of the linear's inputs [in, in], needed by refine and gptq."""
    q = quantize_weight(clipped, group_size)
    if not rounding.needs_hessian:
        return q
    if hessian is None:
        raise ValueError("refine/gptq rounding needs the inputs' Hessian")
    if rounding.refine:
        q = refine_grid(target, q, group_grams(hessian, group_size))
    if rounding.gptq:
        q = gptq_quantize(target, hessian, q)
    return q
