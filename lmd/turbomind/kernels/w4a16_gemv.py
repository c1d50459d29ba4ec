"""Split-K GEMV for one token (decode): CUDA-core FMAs, no tensor cores.

Each program owns BLOCK_N output columns and a short K slice (many small programs keep enough loads in flight to
stream the weights at memory speed). It loads whole packed rows q [BLOCK_K8, BLOCK_N] (one coalesced int32 load per 8
weights), and for nibble i multiplies by the activations x[8r + i]. The scale is taken
out of the nibble sum:  sum_k x_k (c_k s + z) = s * sum_k x_k c_k + z * sum_k x_k  over the 8 k of one packed row,
so a weight costs a shift, a mask, a float conversion and one FMA. The conversion avoids the slow int->float unit:
(c | 0x4B000000) read as fp32 is exactly 2^23 + c.

Reference: `w4a16_layout.w4a16_matmul_reference` (same function; tests compare against it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.w4a16_epilogue import SplitKWorkspace, store_tile


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 128
    block_k8: int = 2  # packed rows (8 weights each) per step
    split_k: int = 64
    num_warps: int = 1
    num_stages: int = 1

    def name(self) -> str:
        return f"gemv n{self.block_n} k{8 * self.block_k8} s{self.split_k} w{self.num_warps} st{self.num_stages}"


@triton.jit
def nibble_as_float(q, i: tl.constexpr):
    """Nibble i (bits 4i..4i+3) of int32 q as an exact fp32 value 0..15, without an int->float conversion."""
    return (((q >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                 GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_K8)
    n_mask = offs_n < N
    k8 = K // 8
    steps = tl.cdiv(k8, BLOCK_K8)
    per_split = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, steps)
    acc = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    for step in range(first, last):
        rows = step * BLOCK_K8 + offs_r
        r_mask = rows < k8
        w_mask = r_mask[:, None] & n_mask[None, :]
        q = tl.load(qw_ptr + rows[:, None] * N + offs_n[None, :], mask=w_mask, other=0, eviction_policy="evict_first")
        if GROUP % (8 * BLOCK_K8) == 0:  # one group row per step
            g = (step * BLOCK_K8 * 8) // GROUP
            s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        else:
            sz_off = ((rows * 8) // GROUP)[:, None] * N + offs_n[None, :]
            s = tl.load(s_ptr + sz_off, mask=w_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz_off, mask=w_mask, other=0.0).to(tl.float32)
        dot = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_K8], dtype=tl.float32)
        for i in tl.static_range(8):
            xi = tl.load(x_ptr + rows * 8 + i, mask=r_mask, other=0.0).to(tl.float32)
            dot += xi[:, None] * nibble_as_float(q, i)
            xsum += xi
        acc += dot * s + xsum[:, None] * z
    tile = tl.sum(acc, axis=0)[None, :]
    store_tile(tile, tl.arange(0, 1), offs_n, M, N, out_ptr, bias_ptr, ws_ptr, cnt_ptr, pid_n, HAS_BIAS, SPLIT_K)


def gemv(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         bias: torch.Tensor | None, cfg: GemvConfig) -> torch.Tensor:
    """x2d [1, K] contiguous -> [1, N] in x's dtype."""
    m, k = x2d.shape
    n = qweight.shape[1]
    if m != 1:
        raise ValueError(f"the GEMV path takes one token, got M={m}")
    group = k // scales.shape[0]
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    tiles_n = triton.cdiv(n, cfg.block_n)
    ws, cnt = SplitKWorkspace.get(x2d.device, m * n, tiles_n) if cfg.split_k > 1 else (out, out)
    _gemv_kernel[(tiles_n, cfg.split_k)](
        x2d, qweight, scales, zeros, bias if bias is not None else out, out, ws, cnt, m, n, k,
        GROUP=group, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K8=cfg.block_k8,
        SPLIT_K=cfg.split_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
