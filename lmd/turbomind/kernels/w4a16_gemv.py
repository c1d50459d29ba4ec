"""Split-K GEMV for the fewest tokens (decode, M of 1 to 4): CUDA-core FMAs, no tensor cores.

Each program owns BLOCK_N output columns and a short K slice (many small programs keep enough loads in flight to
stream the weights at memory speed). It loads whole packed rows q [BLOCK_K8, BLOCK_N] (one coalesced int32 load per 8
weights) and, for nibble i, multiplies by the activations x[m, 8r + i] of each of the BLOCK_M rows.

The work per weight is what bounds this kernel (about one instruction issue per weight per SM lane), so a weight costs
half a shift, a mask-and-or and one FMA per token row:
    f = bits(0x3F800000 | c << 19) = 1 + c/16 exactly (the code in the top mantissa bits of a float in [1, 2)),
and over the weights of one group (scale s, zero z), with dot = sum_k x_k f_k and xs = sum_k x_k,
    sum_k x_k (c_k s + z) = 16 s * dot + (z - 16 s) * xs.
(With the code in the top mantissa bits the cancellation in the last line costs a few bits of 24, not the value.)
One shift serves two nibbles: it puts an odd nibble in bits 19..22 and the even one below it in bits 15..18, which
reads as 1 + c/256; even and odd nibbles keep their own dot and xs, folded with 256 s and 16 s (the even ones lose
8 bits of 24 to the cancellation instead of 4). Measured under the interpreter (K=4096, g128, M=1, against the exact
sum in fp64): normal activations, within 0.55 fp16 ulp of each output (0.50 before); with 8 channels 3000x the
rest and programs of 64 steps, up to 2.9 ulps on the smallest outputs (0.50 before), while the error relative to
the row's largest output (0.5 ulp) and the norm-wise error (2.0e-4) are unchanged.
dot and xs run on over all the steps of a group and are folded once, when the group or the program's slice ends: the
scale and zero loads, their conversions and the fold cost once per group instead of once per packed row. SASS per
64 weights on the steps that do not fold (local sm_90 compile, 8 columns per thread): 312 with a shift per nibble
and a fold per row, 252 with the fold per group, 236 with a shift per pair, 224 with each row's eight x values read
as one vector (4.9 -> 3.5 per weight; the floor of this decode is 2.5: half a shift, a lop3, an FMA).
On the GPU the 8 unit floats of a word come from one PTX block (a shift per pair, one lop3 each: Triton's and/or pair
compiles to two LOP3s, since a LOP3 takes one immediate); the interpreter runs the same math in plain Triton.

Reference: `w4a16_layout.w4a16_matmul_reference` (same function; tests compare against it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.pdl import pdl_options, pdl_prologue
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
def _aligned(q, i: tl.constexpr):
    """q shifted so that nibble i (odd) sits in mantissa bits 19..22 and nibble i - 1 in bits 15..18."""
    return q << (19 - 4 * i) if 4 * i <= 19 else q >> (4 * i - 19)


@triton.jit
def unit_float_pair(q, i: tl.constexpr):
    """Nibbles i (odd) and i - 1 of int32 q from one shift: (1 + c_i/16, 1 + c_(i-1)/256) as exact fp32 values."""
    t = _aligned(q, i)
    return (((t & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True),
            ((t & 0x00078000) | 0x3F800000).to(tl.float32, bitcast=True))


def _unit_floats_ptx() -> str:
    """$0..$7: the fp32 bits of 1 + c_i/16 (odd i) and 1 + c_i/256 (even i) for the 8 nibbles of word $8: one shift
    per pair (as unit_float_pair) and one lop3 ((t & mask) | 1.0f) per nibble. Triton's `(t & mask) | one` becomes
    two LOP3s in SASS (a LOP3 takes one immediate); here `one` sits in a register."""
    lines = ["{", ".reg .b32 t, one;", "mov.b32 one, 0x3F800000;"]
    for i in (1, 3, 5, 7):
        shift = 19 - 4 * i
        lines.append(f"shl.b32 t, $8, {shift};" if shift >= 0 else f"shr.u32 t, $8, {-shift};")
        lines.append(f"lop3.b32 ${i}, t, 0x00780000, one, 0xEA;")
        lines.append(f"lop3.b32 ${i - 1}, t, 0x00078000, one, 0xEA;")
    return "\n".join([*lines, "}"])


UNIT_FLOATS_PTX = tl.constexpr(_unit_floats_ptx())


@triton.jit
def unit_floats(q, PTX: tl.constexpr):
    """The 8 nibbles of int32 q as fp32, nibble order: odd nibbles 1 + c/16, even ones 1 + c/256; one PTX block on
    the GPU, plain Triton otherwise."""
    if PTX:
        f = tl.inline_asm_elementwise(UNIT_FLOATS_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [q], dtype=(tl.int32,) * 8,
                                      is_pure=True, pack=1)
        return (f[0].to(tl.float32, bitcast=True), f[1].to(tl.float32, bitcast=True),
                f[2].to(tl.float32, bitcast=True), f[3].to(tl.float32, bitcast=True),
                f[4].to(tl.float32, bitcast=True), f[5].to(tl.float32, bitcast=True),
                f[6].to(tl.float32, bitcast=True), f[7].to(tl.float32, bitcast=True))
    f1, f0 = unit_float_pair(q, 1)
    f3, f2 = unit_float_pair(q, 3)
    f5, f4 = unit_float_pair(q, 5)
    f7, f6 = unit_float_pair(q, 7)
    return f0, f1, f2, f3, f4, f5, f6, f7


@triton.jit
def _packed_rows(qw_ptr, rows, offs_n, n_mask, N, row_end):
    mask = (rows < row_end)[:, None] & n_mask[None, :]  # also stops the last step's prefetch
    return tl.load(qw_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0, eviction_policy="evict_first")


@triton.jit
def _x_columns(x_ptr, x_off, x_mask, UNMASKED: tl.constexpr):
    """x[m, 8r + i] for the step's packed rows r, i = 0..7, as eight fp32 [BLOCK_K8] tensors from one [BLOCK_K8, 8]
    load (vector loads; eight separate loads were eight scalar LDGs per row)."""
    BLOCK_K8: tl.constexpr = x_off.shape[0]
    xv = load_tile(x_ptr + x_off[:, None] + tl.arange(0, 8)[None, :], x_mask[:, None], 0.0, UNMASKED).to(tl.float32)
    even, odd = tl.split(tl.reshape(xv, (BLOCK_K8, 4, 2)))  # split takes the last axis: i = 2 j + (0 | 1)
    x0_4, x2_6 = tl.split(tl.reshape(even, (BLOCK_K8, 2, 2)))
    x1_5, x3_7 = tl.split(tl.reshape(odd, (BLOCK_K8, 2, 2)))
    x0, x4 = tl.split(x0_4)
    x2, x6 = tl.split(x2_6)
    x1, x5 = tl.split(x1_5)
    x3, x7 = tl.split(x3_7)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _row_step(xi, f, i: tl.constexpr, dh, dl, xh, xl):
    """Nibble i of one token row: odd nibbles (1 + c/16) into dh, xh; even ones (1 + c/256) into dl, xl."""
    if i % 2 == 1:
        dh = dh + xi[:, None] * f
        xh = xh + xi
    else:
        dl = dl + xi[:, None] * f
        xl = xl + xi
    return dh, dl, xh, xl


@triton.jit
def _fold(acc, dh, dl, xh, xl, s, z):
    """sum x (c s + z) = 16 s (dh - xh) + 256 s (dl - xl) + z (xh + xl)."""
    return acc + dh * (16.0 * s) + dl * (256.0 * s) + xh[:, None] * (z - 16.0 * s) + xl[:, None] * (z - 256.0 * s)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                 GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr,
                 SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr, PTX: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
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
    zero_d = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    zero_x = tl.zeros([BLOCK_K8], dtype=tl.float32)
    d0h, d0l, x0h, x0l = zero_d, zero_d, zero_x, zero_x
    d1h, d1l, x1h, x1l = zero_d, zero_d, zero_x, zero_x
    d2h, d2l, x2h, x2l = zero_d, zero_d, zero_x, zero_x
    d3h, d3l, x3h, x3l = zero_d, zero_d, zero_x, zero_x
    for step in range(first, last):
        rows = step * BLOCK_K8 + offs_r
        r_mask = rows < k8
        q = q_next
        q_next = _packed_rows(qw_ptr, rows + BLOCK_K8, offs_n, n_mask, N, row_end)
        x_off = rows * 8
        fs = unit_floats(q, PTX)
        xs0 = _x_columns(x_ptr, x_off, r_mask, EVEN_K)
        if BLOCK_M > 1:  # rows past M read x with a mask even when K is even
            xs1 = _x_columns(x_ptr, x_off + K, r_mask & (offs_r * 0 + 1 < M), False)
        if BLOCK_M > 2:
            xs2 = _x_columns(x_ptr, x_off + 2 * K, r_mask & (offs_r * 0 + 2 < M), False)
            xs3 = _x_columns(x_ptr, x_off + 3 * K, r_mask & (offs_r * 0 + 3 < M), False)
        for i in tl.static_range(8):
            f = fs[i]
            d0h, d0l, x0h, x0l = _row_step(xs0[i], f, i, d0h, d0l, x0h, x0l)
            if BLOCK_M > 1:
                d1h, d1l, x1h, x1l = _row_step(xs1[i], f, i, d1h, d1l, x1h, x1l)
            if BLOCK_M > 2:
                d2h, d2l, x2h, x2l = _row_step(xs2[i], f, i, d2h, d2l, x2h, x2l)
                d3h, d3l, x3h, x3l = _row_step(xs3[i], f, i, d3h, d3l, x3h, x3l)
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
            acc0 = _fold(acc0, d0h, d0l, x0h, x0l, s, z)
            d0h, d0l, x0h, x0l = zero_d, zero_d, zero_x, zero_x
            if BLOCK_M > 1:
                acc1 = _fold(acc1, d1h, d1l, x1h, x1l, s, z)
                d1h, d1l, x1h, x1l = zero_d, zero_d, zero_x, zero_x
            if BLOCK_M > 2:
                acc2 = _fold(acc2, d2h, d2l, x2h, x2l, s, z)
                acc3 = _fold(acc3, d3h, d3l, x3h, x3l, s, z)
                d2h, d2l, x2h, x2l = zero_d, zero_d, zero_x, zero_x
                d3h, d3l, x3h, x3l = zero_d, zero_d, zero_x, zero_x
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
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(x2d.device))
    return out
