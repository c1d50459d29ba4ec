"""Triton residual add + RMSNorm of one decoder-layer boundary: h' = h + delta; normed = weight * rms(h').

The PyTorch reference is `lmd.turbomind.layers.add_rms_norm_reference` (transformers' order: the sum rounded to the
activation dtype, the norm in fp32, rounded to the dtype, then times the weight). One program per token row; the
whole row (hidden size <= 32768) sits in registers, so h' is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.pdl import pdl_options, pdl_prologue


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, H, eps, stride_h, stride_d, stride_s, stride_o,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    y = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


MAX_HIDDEN = 32768


def add_rms_norm_triton(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h, delta [T, H] (rows may be strided, columns contiguous), weight [H] -> (h + delta, normed), both [T, H]."""
    t, hidden = h.shape
    block = triton.next_power_of_2(hidden)
    out = torch.empty((t, hidden), dtype=h.dtype, device=h.device)
    total = h if delta is None else torch.empty_like(out)
    if t:
        d = h if delta is None else delta
        _add_rms_norm_kernel[(t,)](h, d, weight, total, out, hidden, eps, h.stride(0), d.stride(0), total.stride(0),
                                   out.stride(0), HAS_DELTA=delta is not None, BLOCK=block,
                                   num_warps=min(16, max(1, block // 512)), **pdl_options(h.device))
    return total, out
