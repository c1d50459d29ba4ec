"""Triton per-token dynamic quantization of activations for W8A8: absmax and codes of a row in one kernel.

The reference, and the formulas, are in `w8a8_reference.quantize_per_token_reference`. One program per token row
walks the row twice in BLOCK-wide chunks (absmax, then codes), so any K fits; the second pass reads the row back
from L2 at the sizes the engine serves.

FP8 codes are rounded onto the e4m3 grid in fp32 first (round to nearest even, by adding and removing 1.5·2**23 ulps
of the grid step, the step read from the value's exponent bits), so the final cast is exact: the result does not
depend on how a backend's fp32 -> e4m3 conversion rounds (Triton's interpreter rounds up across a power of two
wrongly, e.g. 127.3 -> 64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.w8a8_reference import MIN_ABSMAX, QMAX


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, k, stride_x, stride_q, QMAX_: tl.constexpr, IS_INT8: tl.constexpr,
                  MIN_ABS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    absmax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, k, BLOCK):
        cols = start + offs
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < k, other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(x))
    amax = tl.maximum(tl.max(absmax, axis=0), MIN_ABS)
    inv = QMAX_ / amax
    for start in range(0, k, BLOCK):
        cols = start + offs
        mask = cols < k
        v = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32) * inv
        if IS_INT8:
            r = tl.floor(tl.abs(v) + 0.5)
            v = tl.where(v < 0, -r, r)
        else:
            v = _round_to_e4m3_grid(v)
        v = tl.minimum(tl.maximum(v, -QMAX_), QMAX_)
        tl.store(q_ptr + row * stride_q + cols, v.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, amax / QMAX_)


@triton.jit
def _round_to_e4m3_grid(v):
    """v (|v| <= 448) rounded to nearest even on e4m3's grid: 3 mantissa bits, subnormal step 2**-9."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = step * 12582912.0  # 1.5 * 2**23 steps: adding it leaves no bits below one step
    return (v + magic) - magic


def quantize_per_token_triton(x: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (last dim contiguous) -> (codes [T, K] qdtype, scales fp32 [T])."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D with a contiguous last dim, got shape {tuple(x.shape)} strides {x.stride()}")
    if qdtype not in QMAX:
        raise ValueError(f"qdtype {qdtype} is not int8 or float8_e4m3fn")
    t, k = x.shape
    q = torch.empty((t, k), dtype=qdtype, device=x.device)
    scales = torch.empty((t,), dtype=torch.float32, device=x.device)
    if t:
        block = min(4096, triton.next_power_of_2(k))
        _quant_kernel[(t,)](x, q, scales, k, x.stride(0), q.stride(0), QMAX_=QMAX[qdtype],
                            IS_INT8=qdtype == torch.int8, MIN_ABS=MIN_ABSMAX, BLOCK=block, num_warps=4)
    return q, scales
