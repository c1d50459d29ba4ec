"""Triton SiLU-gated product of the fused gate/up projection: out = silu(gate) * up, gate = gu[:, :I], up = gu[:, I:].

The PyTorch reference is `lmd.turbomind.layers.silu_mul_reference` (silu rounded to the activation dtype, then the
product). Grid: (token rows, column blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.pdl import pdl_options, pdl_prologue


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_triton(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] (columns contiguous) -> [T, I]."""
    t, two_i = gu.shape
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(inter))
    if t:
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gu, out, inter, gu.stride(0), out.stride(0), BLOCK=block,
                                                         num_warps=4, **pdl_options(gu.device))
    return out
