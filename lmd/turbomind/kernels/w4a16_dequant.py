"""Dequantize-then-cuBLAS for large M: a Triton kernel expands the int4 weight to a dense W.T [K, N] in the
activation dtype, then torch.matmul runs at full tensor-core rate. The expansion reads 0.5 byte and writes 2 bytes per
weight, which pays only when M is large enough that the matmul itself dominates.

Reference: `w4a16_layout.dequantize` (same function; tests compare against it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.w4a16_gemv import nibble_as_float


@dataclass(frozen=True)
class DequantConfig:
    block_k8: int = 16
    block_n: int = 128
    num_warps: int = 4

    def name(self) -> str:
        return f"dequant+cublas k{8 * self.block_k8} n{self.block_n} w{self.num_warps}"


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, GROUP: tl.constexpr, BLOCK_K8: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_K8 + tl.arange(0, BLOCK_K8)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < K // 8)[:, None] & (offs_n < N)[None, :]
    q = tl.load(qw_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0)
    sz_off = ((rows * 8) // GROUP)[:, None] * N + offs_n[None, :]
    s = tl.load(s_ptr + sz_off, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + sz_off, mask=mask, other=0.0).to(tl.float32)
    out = w_ptr + (rows * 8)[:, None] * N + offs_n[None, :]
    for i in tl.static_range(8):
        w = nibble_as_float(q, i) * s + z
        tl.store(out + i * N, w.to(w_ptr.dtype.element_ty), mask=mask)


def dequantize_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
                      cfg: DequantConfig = DequantConfig()) -> torch.Tensor:
    """Engine layout -> dense W.T [K, N] in `dtype`."""
    k8, n = qweight.shape
    k = k8 * 8
    w = torch.empty((k, n), dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(k8, cfg.block_k8), triton.cdiv(n, cfg.block_n))
    _dequant_kernel[grid](qweight, scales, zeros, w, n, k, GROUP=k // scales.shape[0], BLOCK_K8=cfg.block_k8,
                          BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    return w


def dequant_matmul(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bias: torch.Tensor | None, cfg: DequantConfig) -> torch.Tensor:
    """x2d [M, K] -> [M, N]: Triton dequant to x's dtype, then cuBLAS (fp32 accumulation inside cuBLAS)."""
    w = dequantize_triton(qweight, scales, zeros, x2d.dtype, cfg)
    if bias is None:
        return x2d @ w
    return torch.addmm(bias.to(x2d.dtype), x2d, w)
