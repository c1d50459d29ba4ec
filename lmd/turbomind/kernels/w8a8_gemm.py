"""Triton W8A8 GEMM with the dequantization in the epilogue: y = (q @ weight.T) * s_x[:, None] * s_w[None, :] + bias.

q int8 / float8_e4m3fn [M, K] (per-token codes, `w8a8_quant`), weight the same dtype [N, K], s_x fp32 [M], s_w fp32
[N]; accumulation in int32 (int8) or fp32 (fp8) on the tensor cores, one fp32 multiply-add per output in the
epilogue, stored (contiguous [M, N]) in the activation dtype by the W4A16 kernels' `cast_bias_store`. The
reference is `w8a8_reference.scaled_mm_reference`.

Tiles are chosen from M (decode: narrow M tiles, many N tiles to fill the SMs; prefill: 128-wide), launched in
GROUP_M-row swizzled order so consecutive programs share weight tiles in L2. Under TRITON_INTERPRET=1 small tiles keep
the interpreter fast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.w4a16_epilogue import cast_bias_store


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tiles_for(m: int) -> Tiles:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return Tiles(16, 32, 32, 1, 1)
    if m <= 16:
        return Tiles(16, 64, 256, 4, 4)
    if m <= 32:
        return Tiles(32, 64, 256, 4, 4)
    if m <= 64:
        return Tiles(64, 64, 128, 4, 4)
    if m <= 128:
        return Tiles(64, 128, 128, 4, 4)
    if m <= 512:
        return Tiles(128, 128, 128, 8, 3)
    return Tiles(128, 256, 128, 8, 3)


@triton.jit
def _scaled_mm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bn,
                      stride_bk, HAS_BIAS: tl.constexpr, IS_INT8: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * stride_bn + rk[:, None] * stride_bk  # weight^T tile [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if IS_INT8 else tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0.0)
        b = tl.load(b_ptrs, mask=(rk[:, None] + k0 < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32 if IS_INT8 else tl.float32)  # int8 MMA accumulates in int32
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
    sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
    cast_bias_store(acc.to(tl.float32) * sa[:, None] * sb[None, :], rm, rn, M, N, c_ptr, bias_ptr, HAS_BIAS)


def scaled_mm_triton(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype, tiles: Tiles | None = None) -> torch.Tensor:
    """q [M, K], weight [N, K] (same 8-bit dtype), x_scale fp32 [M], weight_scale fp32 [N] -> y [M, N] out_dtype."""
    if q.dtype != weight.dtype or q.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"q {q.dtype} and weight {weight.dtype} must both be int8 or both float8_e4m3fn")
    m, k = q.shape
    n, k_w = weight.shape
    if k != k_w or x_scale.shape != (m,) or weight_scale.shape != (n,):
        raise ValueError(f"shapes q {tuple(q.shape)}, weight {tuple(weight.shape)}, x_scale {tuple(x_scale.shape)}, "
                         f"weight_scale {tuple(weight_scale.shape)} do not match")
    if x_scale.dtype != torch.float32 or weight_scale.dtype != torch.float32:
        raise ValueError("x_scale and weight_scale must be float32")
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    t = tiles or tiles_for(m)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    _scaled_mm_kernel[grid](q, weight, out, x_scale, weight_scale, bias if bias is not None else weight_scale,
                            m, n, k, q.stride(0), q.stride(1), weight.stride(0), weight.stride(1),
                            HAS_BIAS=bias is not None, IS_INT8=q.dtype == torch.int8,
                            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=8,
                            num_warps=t.num_warps, num_stages=t.num_stages)
    return out
