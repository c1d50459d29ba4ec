"""Skinny dense GEMM on tensor cores for decode batches (M of 2 to 256 token rows): y[M, N] = x[M, K] @ W[N, K]^T.

cuBLAS streams the Llama-7B/8B decode weights at 2.8-3.9 TB/s at M = 16-64 on an H200 (docs/benchmarks.md), short
of the ~4.3 TB/s a plain read reaches: its tiles leave waves half empty (N = 4096 is 32 tiles of 128 on 132 SMs) and
few loads are in flight. Here the operands are swapped, as in the W4A16 `wt` kernels: the weight tile is the MMA's
row operand (BLOCK_N rows, the 64-row granule of Hopper's wgmma), the few token rows its column operand, so a
program owns BLOCK_N output features of every token row. Split-K gives the grid enough programs: each of SPLIT_K
programs of a column tile walks one contiguous slice of K and writes an fp32 partial; a second small kernel sums the
partials in a fixed order (deterministic, unlike atomics) and adds the bias. SPLIT_K = 1 stores the output directly.

The split-K join needs no second kernel: each program writes its partial, then counts itself in on its column tile's
counter; the last of the tile's SPLIT_K programs sums the partials in split order (the same sum whoever finishes
last, and the same as `_split_sum_kernel`'s), stores the output and zeroes the counter for the next call. A
separate launch of `_split_sum_kernel` cost ~1.5 µs a call in the batch-64 step (docs/benchmarks.md); it remains
for launches with more column tiles than counters. Invariant: one set of counters per device, shared by every
call: the calls on a device run in one stream (the engine's step, its CUDA graphs, the planner's timings), and a
call's joins complete before the next call reads the counters (stream order; under PDL a kernel touches them only
after its griddepcontrol.wait).

With `tma`, both operands come through Hopper's tensor-memory copy engine (host-built descriptors, the tiles out of
bounds zero-filled, so the loop has no masks or address arithmetic) and Triton pipelines the copies on mbarriers;
the pointer version stays for GPUs without it and for operands a descriptor cannot take (a base or row stride not
16-byte aligned).

Reference: `torch.nn.functional.linear` (CI compares under the interpreter; the GPU check and the timing against
cuBLAS are in benchmarks/dense_mma_probe.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lmd.turbomind.kernels.pdl import pdl_options, pdl_prologue, pdl_prologue_prefetching, prefetch_flags, weight_lines

MAX_M = 256
MAX_JOIN_TILES = 4096  # column tiles a split-K launch joins in-kernel (counters kept per device)


@dataclass(frozen=True)
class DenseMmaConfig:
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    tma: bool = False
    prefetch: int = 0  # key tiles of the weight slice prefetched into L2 before the PDL wait (pdl.py)

    def name(self) -> str:
        tma = " tma" if self.tma else ""
        pf = f" pf{self.prefetch}" if self.prefetch else ""
        return f"mma n{self.block_n} k{self.block_k} w{self.num_warps} st{self.num_stages} s{self.split_k}{tma}{pf}"


@triton.jit
def _dense_mma_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                      stride_ym, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, JOIN: tl.constexpr,
                      SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, PF_LINES: tl.constexpr, LINE: tl.constexpr,
                      USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    pdl_prologue_prefetching(USE_PDL, weight_lines(w_ptr, rn, N, K, k_start, stride_wn, PF_LINES, LINE), PREFETCH)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    m_mask = rm < M
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (k_start + rk)[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_start + rk)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_mask = rk < k_end - k
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    _store_output(acc, rn, rm, pid_n, pid_k, M, N, b_ptr, y_ptr, part_ptr, cnt_ptr, stride_ym, HAS_BIAS, PARTIAL,
                  JOIN, SPLIT_K)


@triton.jit
def _store_output(acc, rn, rm, pid_n, pid_k, M, N, b_ptr, y_ptr, part_ptr, cnt_ptr, stride_ym, HAS_BIAS: tl.constexpr,
                  PARTIAL: tl.constexpr, JOIN: tl.constexpr, SPLIT_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (y's transpose) into y with the bias, or into this split's fp32 partial [M, N] (and,
    with JOIN, the column tile's last split sums the partials into y: module docstring)."""
    n_mask = rn < N
    out_mask = n_mask[:, None] & (rm < M)[None, :]
    y_ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:  # partials [SPLIT_K, M, N], fp32
        part_ptrs = part_ptr + rm[None, :] * N + rn[:, None]
        tl.store(part_ptrs + pid_k * M * N, acc, mask=out_mask)
        if JOIN:
            tl.debug_barrier()  # every thread's share of the partial written before the counter says so
            seen = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if seen == SPLIT_K - 1:
                tl.debug_barrier()
                # the order and operations of _split_sum_kernel: the same bits whichever path ran
                total = tl.load(part_ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):
                    total += tl.load(part_ptrs + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # zero again for the next call


@triton.jit
def _dense_mma_tma_kernel(x_desc, w_desc, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, k_per_split, stride_wn,
                          stride_ym, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, JOIN: tl.constexpr,
                          SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, PF_LINES: tl.constexpr, LINE: tl.constexpr,
                          USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    pdl_prologue_prefetching(USE_PDL, weight_lines(w_ptr, rn, N, K, k_start, stride_wn, PF_LINES, LINE), PREFETCH)
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        acc = tl.dot(w_desc.load([n0, k]), tl.trans(x_desc.load([0, k])), acc)
    _store_output(acc, rn, tl.arange(0, BLOCK_M), pid_n, pid_k, M, N, b_ptr, y_ptr, part_ptr, cnt_ptr, stride_ym,
                  HAS_BIAS, PARTIAL, JOIN, SPLIT_K)


@triton.jit
def _split_sum_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                      BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):  # fixed order: the same sum on every run
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + (offs // N) * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def block_m_for(m: int) -> int:
    """Token rows padded to the MMA's column operand (at least 16)."""
    return max(16, triton.next_power_of_2(m))


def tma_fits(t: torch.Tensor) -> bool:
    """A 2-D operand a tensor descriptor can take: 16-byte aligned base and row stride, unit column stride."""
    row_bytes = t.stride(0) * t.element_size()
    return t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0 and row_bytes % 16 == 0


def dense_mma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              config: DenseMmaConfig = DenseMmaConfig()) -> torch.Tensor:
    """x [M, K] (M <= MAX_M, rows contiguous along K), weight [N, K] contiguous -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert 0 < m <= MAX_M and weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1, (x.shape,
                                                                                                     weight.shape)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # every split but the last walks a whole number of key tiles
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    b = bias if bias is not None else weight
    grid = (triton.cdiv(n, config.block_n), split)
    join = split > 1 and grid[0] <= MAX_JOIN_TILES
    counters = _join_counters(x.device) if join else y
    flags = dict(HAS_BIAS=bias is not None, PARTIAL=split > 1, JOIN=join, SPLIT_K=split, BLOCK_M=block_m_for(m),
                 BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
                 num_stages=config.num_stages, **prefetch_flags(config.prefetch, config.block_k, weight),
                 **pdl_options(x.device))
    if config.tma and tma_fits(x) and tma_fits(weight):
        x_desc = TensorDescriptor.from_tensor(x, [block_m_for(m), config.block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
        _dense_mma_tma_kernel[grid](x_desc, w_desc, weight, b, y, part, counters, m, n, k, k_per_split,
                                    weight.stride(0), y.stride(0), **flags)
    else:
        _dense_mma_kernel[grid](x, weight, b, y, part, counters, m, n, k, k_per_split, x.stride(0), weight.stride(0),
                                y.stride(0), **flags)
    if split > 1 and not join:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](part, b, y, m, n, y.stride(0), HAS_BIAS=bias is not None,
                                                         SPLIT_K=split, BLOCK=block, num_warps=4,
                                                         **pdl_options(x.device))
    return y


@functools.cache
def _join_counters(device: torch.device) -> torch.Tensor:
    # kept for the process: a captured CUDA graph holds its address; all zero between calls (module docstring)
    return torch.zeros(MAX_JOIN_TILES, dtype=torch.int32, device=device)
