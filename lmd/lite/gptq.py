"""GPTQ error feedback on a fixed int4 grid (static groups), applied after AWQ's scaling and clipping.

This goes beyond AWQ: AWQ rounds every weight to its nearest grid point, GPTQ (Frantar et al., 2022) rounds the input
columns one at a time and spreads each column's rounding error over the columns not yet rounded, weighted by the
inverse Hessian H^-1 of the layer's inputs (H = mean x x^T over the calibration tokens), so that the layer's *output*
error stays small. Here the per-(row, group) grid — fp16 scale and integer zero point — is fixed beforehand by AWQ's
min-max/clip (optionally refined), as GPTQ's "static groups" do, so the result is the same AutoAWQ format.

    H += damp * mean(diag H) * I;  U = chol(H^-1) (upper)
    for each block of columns (lazy batch updates), for each column i in it:
        q_i = grid(w_i);  e = (w_i - q_i) / U_ii;  w_j -= e * U_ij  for the later columns j of the block
    then the columns after the block get the block's errors at once: W_rest -= E · U_block,rest
With act_order the columns go in order of decreasing H_ii (the most active inputs first); each column keeps its own
group's grid, so the order does not change the format.
"""

from __future__ import annotations

import torch

from lmd.errors import LmdError
from lmd.lite.quantizer import MAX_CODE, SCALE_DTYPE, QuantizedWeight

DAMP = 0.01
BLOCK_SIZE = 128


def _inverse_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp·mean(diag H)·I)^-1; the damping grows tenfold while H is not positive."""
    eye = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
    mean_diag = float(torch.diagonal(hessian).mean())
    for attempt in range(4):
        factor, info = torch.linalg.cholesky_ex(hessian + damp * 10**attempt * mean_diag * eye)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(factor)
            return torch.linalg.cholesky(inverse, upper=True)
    raise LmdError(
        f"GPTQ: the input Hessian is not positive definite even with damp {damp * 1000:g}; "
        "calibrate on more or longer samples (--calib-samples, --calib-seqlen)"
    )


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    grid: QuantizedWeight,
    damp: float = DAMP,
    act_order: bool = True,
    block_size: int = BLOCK_SIZE,
) -> QuantizedWeight:
    """weight [out, in] float, hessian [in, in] (mean x x^T of the inputs), grid: the per-group scales and zero points
    to keep (its codes are ignored). Returns new codes on that grid."""
    out, inp = weight.shape
    g = grid.group_size
    w = weight.to(torch.float32).clone()
    h = hessian.to(torch.float32).to(w.device).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    scale = grid.scales.to(torch.float32).to(w.device).repeat_interleave(g, dim=1)
    zero = grid.zeros.to(torch.float32).to(w.device).repeat_interleave(g, dim=1)
    order = torch.argsort(torch.diagonal(h), descending=True) if act_order else torch.arange(inp, device=w.device)
    w, h, scale, zero = w[:, order], h[order][:, order], scale[:, order], zero[:, order]
    u = _inverse_cholesky(h, damp)
    codes = torch.empty_like(w)
    for i1 in range(0, inp, block_size):
        i2 = min(i1 + block_size, inp)
        block = w[:, i1:i2].clone()
        errors = torch.empty_like(block)
        u_block = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            code = torch.clamp(torch.round(block[:, i] / scale[:, col]) + zero[:, col], 0, MAX_CODE)
            codes[:, col] = code
            err = (block[:, i] - (code - zero[:, col]) * scale[:, col]) / u_block[i, i]
            block[:, i:] -= err.unsqueeze(1) * u_block[i, i:].unsqueeze(0)
            errors[:, i] = err
        w[:, i2:] -= errors @ u[i1:i2, i2:]
    codes = codes[:, torch.argsort(order)]
    return QuantizedWeight(
        codes=codes.to(torch.uint8), zeros=grid.zeros.clone(), scales=grid.scales.to(SCALE_DTYPE).clone(), group_size=g
    )
