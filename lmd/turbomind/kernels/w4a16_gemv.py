"""Split-K GEMV for the fewest tokens (decode, M of 1 to 4): CUDA-core FMAs, no tensor cores.

Each program owns BLOCK_N output columns and a short K slice (many small programs keep enough loads in flight to
stream the weights at memory speed). It loads whole packed rows q [BLOCK_K8, BLOCK_N] (one coalesced int32 load per 8
weights) and, for nibble i, multiplies by the activations x[m, 8r + i] of each of the BLOCK_M rows.

The work per weight is what bounds this kernel (about one instruction issue per weight per SM lane), so a weight costs
a shift, a mask-and-or and one FMA per token row:
    f = bits(0x3F800000 | c << 19) = 1 + c/16 exactly (the code in the top mantissa bits of a float in [1, 2)),
and over the weights of one group (scale s, zero z), with dot = sum_k x_k f_k and xs = sum_k x_k,
    sum_k x_k (c_k s + z) = 16 s * dot + (z - 16 s) * xs.
(With the code in the top mantissa bits the cancellation in the last line costs a few bits of 24, not the value.)
dot and xs run on over all the steps of a group and are folded once, when the group or the program's slice ends: the
scale and zero loads, their conversions and the fold cost once per group instead of once per packed row (local
sm_90 compile, 8 columns per thread: 312 -> 252 SASS instructions per 64 weights on the steps that do not fold).
On the GPU the 8 unit floats of a word come from one PTX block (a shift and one lop3 each: Triton's and/or pair
compiles to two LOP3s, since a LOP3 takes one immediate); the interpreter runs the same math in plain Triton.

Reference: `w4a16_layout.w4a16_matmul_reference` (same function; tests compare against it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.w4a16_epilogue import SplitKWorkspace, load_tile, split_k_steps, store_tile


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 128
    block_k8: int = 2  # packed rows (8 weights each) per step
    split_k: int = 64
    num_warps: int = 1
    num_stages: int = 1
    block_m: int = 1  # token rows per program: 1, 2 or 4

    def name(self) -> str:
        return (f"gemv m{self.block_m} n{self.block_n} k{8 * self.block_k8} s{self.split_k} w{self.num_warps} "
                f"st{self.num_stages}")


@triton.jit
def nibble_as_float(q, i: tl.constexpr):
    """Nibble i (bits 4i..4i+3) of int32 q as an exact fp32 value 0..15, without an int->float conversion."""
    return (((q >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def nibble_as_unit_float(q, i: tl.constexpr):
    """Nibble i of int32 q as the fp32 1 + c/16 (exact): the code moved to mantissa bits 19..22 of 1.0f."""
    t = q << (19 - 4 * i) if 4 * i <= 19 else q >> (4 * i - 19)
    return ((t & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


def _unit_floats_ptx() -> str:
    """$0..$7: 1 + c_i / 16 as fp32 bits for the 8 nibbles of word $8, each a shift (nibble i to bits 19..22, as in
    nibble_as_unit_float) and one lop3 ((t & mask) | 1.0f). Triton's `(t & mask) | one` becomes two LOP3s in SASS (a
    LOP3 takes one immediate); here `one` sits in a register."""
    lines = ["{", ".reg .b32 t, one;", "mov.b32 one, 0x3F800000;"]
    for i in range(8):
        shift = 19 - 4 * i
        lines.append(f"shl.b32 t, $8, {shift};" if shift >= 0 else f"shr.u32 t, $8, {-shift};")
        lines.append(f"lop3.b32 ${i}, t, 0x00780000, one, 0xEA;")
    return "\n".join([*lines, "}"])


UNIT_FLOATS_PTX = tl.constexpr(_unit_floats_ptx())


@triton.jit
def unit_floats(q, PTX: tl.constexpr):
    """The 8 nibbles of int32 q as fp32 1 + c/16, nibble order; one PTX block on the GPU, plain Triton otherwise."""
    if PTX:
        f = tl.inline_asm_elementwise(UNIT_FLOATS_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [q], dtype=(tl.int32,) * 8,
                                      is_pure=True, pack=1)
        return (f[0].to(tl.float32, bitcast=True), f[1].to(tl.float32, bitcast=True),
                f[2].to(tl.float32, bitcast=True), f[3].to(tl.float32, bitcast=True),
                f[4].to(tl.float32, bitcast=True), f[5].to(tl.float32, bitcast=True),
                f[6].to(tl.float32, bitcast=True), f[7].to(tl.float32, bitcast=True))
    return (nibble_as_unit_float(q, 0), nibble_as_unit_float(q, 1), nibble_as_unit_float(q, 2),
            nibble_as_unit_float(q, 3), nibble_as_unit_float(q, 4), nibble_as_unit_float(q, 5),
            nibble_as_unit_float(q, 6), nibble_as_unit_float(q, 7))


@triton.jit
def _packed_rows(qw_ptr, rows, offs_n, n_mask, N, row_end):
    mask = (rows < row_end)[:, None] & n_mask[None, :]  # also stops the last step's prefetch
    return tl.load(qw_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0, eviction_policy="evict_first")


@triton.jit
def _row_step(x_ptr, x_off, x_mask, f, i: tl.constexpr, dot, xs, EVEN_K: tl.constexpr):
    xi = load_tile(x_ptr + x_off + i, x_mask, 0.0, EVEN_K).to(tl.float32)
    return dot + xi[:, None] * f, xs + xi


@triton.jit
def _fold(acc, dot, xs, s16, zc):
    return acc + dot * s16 + xs[:, None] * zc


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                 GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr,
                 SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr, PTX: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_K8)
    n_mask = offs_n < N
    k8 = K // 8
    steps = tl.cdiv(k8, BLOCK_K8)
    first, last = split_k_steps(pid_k, steps, SPLIT_K)
    acc0 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    # the next step's packed rows are loaded before this step's math (a register double buffer): with one warp per
    # program, nothing else would overlap the FMAs with the memory latency
    row_end = tl.minimum(last * BLOCK_K8, k8)  # end of this program's slice
    q_next = _packed_rows(qw_ptr, first * BLOCK_K8 + offs_r, offs_n, n_mask, N, row_end)
    # dot (sum of x * unit float) and xs (sum of x) run on over the steps of one group and are folded with its
    # scale and zero once, when the group (or this program's slice) ends; groups shorter than a step fold per step
    # with per-row scales
    ONE_GROUP: tl.constexpr = GROUP % (8 * BLOCK_K8) == 0
    dot0 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    dot1 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    dot2 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    dot3 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    xs0 = tl.zeros([BLOCK_K8], dtype=tl.float32)
    xs1 = tl.zeros([BLOCK_K8], dtype=tl.float32)
    xs2 = tl.zeros([BLOCK_K8], dtype=tl.float32)
    xs3 = tl.zeros([BLOCK_K8], dtype=tl.float32)
    for step in range(first, last):
        rows = step * BLOCK_K8 + offs_r
        r_mask = rows < k8
        q = q_next
        q_next = _packed_rows(qw_ptr, rows + BLOCK_K8, offs_n, n_mask, N, row_end)
        x_off = rows * 8
        fs = unit_floats(q, PTX)
        for i in tl.static_range(8):
            f = fs[i]
            dot0, xs0 = _row_step(x_ptr, x_off, r_mask, f, i, dot0, xs0, EVEN_K)
            if BLOCK_M > 1:  # rows past M read x with a mask even when K is even
                dot1, xs1 = _row_step(x_ptr, x_off + K, r_mask & (offs_r * 0 + 1 < M), f, i, dot1, xs1, False)
            if BLOCK_M > 2:
                dot2, xs2 = _row_step(x_ptr, x_off + 2 * K, r_mask & (offs_r * 0 + 2 < M), f, i, dot2, xs2, False)
                dot3, xs3 = _row_step(x_ptr, x_off + 3 * K, r_mask & (offs_r * 0 + 3 < M), f, i, dot3, xs3, False)
        group_ends = ((step + 1) * BLOCK_K8 * 8) % GROUP == 0
        if not ONE_GROUP or group_ends or step + 1 == last:
            if ONE_GROUP:  # one group row for the whole step
                g = (step * BLOCK_K8 * 8) // GROUP
                s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            else:
                w_mask = r_mask[:, None] & n_mask[None, :]
                sz_off = ((rows * 8) // GROUP)[:, None] * N + offs_n[None, :]
                s = tl.load(s_ptr + sz_off, mask=w_mask, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + sz_off, mask=w_mask, other=0.0).to(tl.float32)
            s16 = 16.0 * s
            zc = z - s16
            acc0 = _fold(acc0, dot0, xs0, s16, zc)
            dot0 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
            xs0 = tl.zeros([BLOCK_K8], dtype=tl.float32)
            if BLOCK_M > 1:
                acc1 = _fold(acc1, dot1, xs1, s16, zc)
                dot1 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
                xs1 = tl.zeros([BLOCK_K8], dtype=tl.float32)
            if BLOCK_M > 2:
                acc2 = _fold(acc2, dot2, xs2, s16, zc)
                acc3 = _fold(acc3, dot3, xs3, s16, zc)
                dot2 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
                dot3 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
                xs2 = tl.zeros([BLOCK_K8], dtype=tl.float32)
                xs3 = tl.zeros([BLOCK_K8], dtype=tl.float32)
    # each token row has its own split-K counter: tile id = column tile * BLOCK_M + row
    row = tl.arange(0, 1)
    store_tile(tl.sum(acc0, axis=0)[None, :], row, offs_n, M, N, out_ptr, bias_ptr, ws_ptr, cnt_ptr,
               pid_n * BLOCK_M, HAS_BIAS, SPLIT_K)
    if BLOCK_M > 1:
        store_tile(tl.sum(acc1, axis=0)[None, :], row + 1, offs_n, M, N, out_ptr, bias_ptr, ws_ptr, cnt_ptr,
                   pid_n * BLOCK_M + 1, HAS_BIAS, SPLIT_K)
    if BLOCK_M > 2:
        store_tile(tl.sum(acc2, axis=0)[None, :], row + 2, offs_n, M, N, out_ptr, bias_ptr, ws_ptr, cnt_ptr,
                   pid_n * BLOCK_M + 2, HAS_BIAS, SPLIT_K)
        store_tile(tl.sum(acc3, axis=0)[None, :], row + 3, offs_n, M, N, out_ptr, bias_ptr, ws_ptr, cnt_ptr,
                   pid_n * BLOCK_M + 3, HAS_BIAS, SPLIT_K)


def gemv(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         bias: torch.Tensor | None, cfg: GemvConfig) -> torch.Tensor:
    """x2d [M, K] (M <= cfg.block_m, contiguous) -> [M, N] in x's dtype."""
    m, k = x2d.shape
    n = qweight.shape[1]
    if m > cfg.block_m or cfg.block_m not in (1, 2, 4):
        raise ValueError(f"GEMV config for M <= {cfg.block_m} (1, 2 or 4) called with M={m}")
    group = k // scales.shape[0]
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    tiles_n = triton.cdiv(n, cfg.block_n)
    ws, cnt = SplitKWorkspace.get(x2d.device, m * n, tiles_n * cfg.block_m) if cfg.split_k > 1 else (out, out)
    _gemv_kernel[(tiles_n, cfg.split_k)](
        x2d, qweight, scales, zeros, bias if bias is not None else out, out, ws, cnt, m, n, k,
        GROUP=group, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K8=cfg.block_k8,
        SPLIT_K=cfg.split_k, BLOCK_M=cfg.block_m, EVEN_K=k % (8 * cfg.block_k8) == 0, PTX=x2d.is_cuda,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
