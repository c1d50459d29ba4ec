"""Skinny dense GEMM for decode (M of 1 to 8 token rows): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), CUDA-core FMAs.

At these M a linear is a stream of its weights; what matters is keeping enough loads in flight to read them at
memory speed. Each program owns BLOCK_N weight rows (contiguous along K: coalesced loads) and walks the whole K,
accumulating x * w elementwise in an fp32 [BLOCK_M, BLOCK_N, BLOCK_K] register tile, reduced over K once at the
end: one FMA per weight per token row inside the loop, no cross-lane reduction until the end, no split-K pass.

Reference: `torch.nn.functional.linear` (tests compare against it under the interpreter; the GPU check and the
timing against cuBLAS are in benchmarks/dense_gemv_probe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.pdl import pdl_options, pdl_prologue_prefetching, prefetch_flags, weight_lines

MAX_M = 8


@dataclass(frozen=True)
class DenseGemvConfig:
    block_n: int = 4
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    prefetch: int = 0  # key tiles of the weight rows prefetched into L2 before the PDL wait (pdl.py)

    def name(self) -> str:
        pf = f" pf{self.prefetch}" if self.prefetch else ""
        return f"gemv n{self.block_n} k{self.block_k} w{self.num_warps} st{self.num_stages}{pf}"


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PREFETCH: tl.constexpr, PF_LINES: tl.constexpr, LINE: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    pdl_prologue_prefetching(USE_PDL, weight_lines(w_ptr, rn, N, K, 0, stride_wn, PF_LINES, LINE), PREFETCH)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = rk < K - k
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               config: DenseGemvConfig = DenseGemvConfig()) -> torch.Tensor:
    """x [M, K] (M <= MAX_M, rows contiguous), weight [N, K] contiguous -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert 0 < m <= MAX_M and weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1, (x.shape,
                                                                                                     weight.shape)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = triton.next_power_of_2(m)
    _dense_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **prefetch_flags(config.prefetch, config.block_k, weight), **pdl_options(x.device))
    return y
