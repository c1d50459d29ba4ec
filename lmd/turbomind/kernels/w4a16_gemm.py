"""Tensor-core W4A16 GEMM: split-K for small M, plain tiles for medium M (one kernel, SPLIT_K picks the mode).

Each program computes a [BLOCK_M, BLOCK_N] tile of y over one K slice. Per step it loads x [BLOCK_M, BLOCK_K] and
the packed weights addressed per unpacked row, q[k // 8, n] (the same int32 serves 8 consecutive rows from L1),
shifts out nibble k % 8, dequantizes with one FMA in the activation dtype (code * scale + zero, zero already
-z*scale) and feeds tl.dot with an fp32 accumulator. When BLOCK_K divides the group size a step needs a single row of
scales and zeros.

Reference: `w4a16_layout.w4a16_matmul_reference` (same function; tests compare against it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.w4a16_epilogue import split_k_steps, store_tile, tile_launch_buffers


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    group_m: int = 8  # M tiles walked together so that their weight tiles are shared through L2
    num_warps: int = 4
    num_stages: int = 1
    nibble_dots: bool = False  # 8 dots per step over packed rows (BLOCK_K >= 128) instead of one over unpacked rows

    def name(self) -> str:
        return (f"gemm{'-nd' if self.nibble_dots else ''} m{self.block_m} n{self.block_n} k{self.block_k} "
                f"s{self.split_k} w{self.num_warps} st{self.num_stages}")


@triton.jit
def nibble_as_act(q, shift, dtype: tl.constexpr):
    """Nibble at `shift` of int32 q as an exact fp16/bf16 value 0..15: OR-ing the code into the mantissa of 1024
    (fp16 0x6400) or 128 (bf16 0x4300) and subtracting avoids both int->float and fp32->fp16 conversions."""
    if dtype == tl.float16:
        return (((q >> shift) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    else:
        return (((q >> shift) & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 128.0


@triton.jit
def _packed_tile(qw_ptr, step, offs_n, n_mask, N, row_end, BLOCK_K: tl.constexpr):
    rows = step * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    mask = (rows < row_end)[:, None] & n_mask[None, :]
    return tl.load(qw_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0)


@triton.jit
def _nibble_dots_step(acc, q, x_ptr, s_ptr, z_ptr, offs_m, offs_n, m_mask, n_mask, step, N, K,
                      GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step as 8 dots, one per nibble: packed rows q are loaded once (no 8x re-read), and dot i pairs the
    weights of k = 8r + i with the activation columns 8r + i (a strided, cache-served load of the small x)."""
    rows = step * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    r_mask = rows < K // 8
    w_mask = r_mask[:, None] & n_mask[None, :]
    x_off = offs_m[:, None] * K + (rows * 8)[None, :]
    x_mask = m_mask[:, None] & r_mask[None, :]
    dtype = x_ptr.dtype.element_ty
    if GROUP % BLOCK_K == 0:
        g = (step * BLOCK_K) // GROUP
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(dtype)[None, :]
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(dtype)[None, :]
    else:
        sz_off = ((rows * 8) // GROUP)[:, None] * N + offs_n[None, :]
        s = tl.load(s_ptr + sz_off, mask=w_mask, other=0.0).to(dtype)
        z = tl.load(z_ptr + sz_off, mask=w_mask, other=0.0).to(dtype)
    for i in tl.static_range(8):
        xi = tl.load(x_ptr + x_off + i, mask=x_mask, other=0.0)
        acc = tl.dot(xi, nibble_as_act(q, 4 * i, dtype) * s + z, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                 GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, NIBBLE_DOTS: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_band = GROUP_M * tiles_n
    first_m = (pid // in_band) * GROUP_M
    band_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_band) % band_m
    pid_n = (pid % in_band) // band_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    shift = ((offs_k % 8) * 4)[:, None]
    steps = tl.cdiv(K, BLOCK_K)
    first, last = split_k_steps(pid_k, steps, SPLIT_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if NIBBLE_DOTS:  # packed rows double-buffered in registers: the next tile loads during this one's dots
        row_end = tl.minimum(last * (BLOCK_K // 8), K // 8)
        q_next = _packed_tile(qw_ptr, first, offs_n, n_mask, N, row_end, BLOCK_K)
    for step in range(first, last):
        if NIBBLE_DOTS:
            q = q_next
            q_next = _packed_tile(qw_ptr, step + 1, offs_n, n_mask, N, row_end, BLOCK_K)
            acc = _nibble_dots_step(acc, q, x_ptr, s_ptr, z_ptr, offs_m, offs_n, m_mask, n_mask, step, N, K,
                                    GROUP, BLOCK_K)
        else:
            ks = step * BLOCK_K + offs_k
            k_mask = ks < K
            x = tl.load(x_ptr + offs_m[:, None] * K + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & n_mask[None, :]
            q = tl.load(qw_ptr + (ks // 8)[:, None] * N + offs_n[None, :], mask=w_mask, other=0)
            codes = nibble_as_act(q, shift, x.dtype)
            if GROUP % BLOCK_K == 0:
                g = (step * BLOCK_K) // GROUP
                s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(x.dtype)[None, :]
                z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(x.dtype)[None, :]
            else:
                sz_off = (ks // GROUP)[:, None] * N + offs_n[None, :]
                s = tl.load(s_ptr + sz_off, mask=w_mask, other=0.0).to(x.dtype)
                z = tl.load(z_ptr + sz_off, mask=w_mask, other=0.0).to(x.dtype)
            acc = tl.dot(x, codes * s + z, acc)
    tile_id = pid_m * tiles_n + pid_n
    store_tile(acc, offs_m, offs_n, M, N, out_ptr, bias_ptr, ws_ptr, cnt_ptr, tile_id, HAS_BIAS, SPLIT_K)


def gemm(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         bias: torch.Tensor | None, cfg: GemmConfig) -> torch.Tensor:
    """x2d [M, K] contiguous -> [M, N] in x's dtype."""
    m, n, k, group, tiles, out, ws, cnt = tile_launch_buffers(x2d, qweight, scales, cfg.block_m, cfg.block_n,
                                                              cfg.split_k)
    _gemm_kernel[(tiles, cfg.split_k)](
        x2d, qweight, scales, zeros, bias if bias is not None else out, out, ws, cnt, m, n, k,
        GROUP=group, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, GROUP_M=cfg.group_m, NIBBLE_DOTS=cfg.nibble_dots, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out
