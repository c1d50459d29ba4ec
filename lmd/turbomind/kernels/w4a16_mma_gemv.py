"""W4A16 for 1 to 16 token rows on the tensor cores' warp-level MMA (`mma.sync.m16n8k16`), in CUDA C++ (NVRTC).

y.T = W x.T, the dequantized weight as the MMA's A operand (16 output channels x 16 input channels, from registers),
the activations as B (16 input channels x 8 token rows; rows past M are zeros). A token row count this small leaves
the tensor cores idle either way: what the kernel must do is stream the packed weights at memory speed with few
instructions per weight. It reads the engine layout as it is (no reorder): a thread loads two 16-byte vectors of
one packed row, qweight[kw, n0 + 8g .. n0 + 8g + 7], and that word set is its whole A fragment for two k16 steps and
four 16-channel tiles. Which input channel and which output channel each fragment slot stands for is ours to choose
(a sum over k does not care about order, and the outputs are stored where they belong), so:

    lane = 4 g + t (g = 0..7, t = 0..3), a k32 step at k0, the warp's 64 output channels at c0:
    packed word e (0..7) of the thread = qweight[(k0 + 8 t) / 8, c0 + 8 g + e]
    A tile j (0..3), row g      <- word 2 j        (output channel c0 + 8 g + 2 j)
                     row g + 8  <- word 2 j + 1    (output channel c0 + 8 g + 2 j + 1)
    k16 step h (0, 1): fragment columns (2t, 2t+1) <- nibbles (2h, 2h+4), columns (2t+8, 2t+9) <- (2h+1, 2h+5)
    B (the same columns) <- x[m, k0 + 8 t + nibble]: one 16-byte load of x[m, k0 + 8 t ..] and two PRMTs a step

Decode: a nibble placed in the mantissa of 1.0 reads as 1 + c/16 exactly (fp16: bits 6..9, bf16: bits 3..6), and
one shift puts nibbles i and i + 4 of a word into both halves of a register: a shift and a LOP3 per two weights,
no conversion, no subtraction. The MMA sums D = sum_k x_k (1 + c_k/16) per group (fp32), a second MMA with an
all-ones A sums xs = sum_k x_k, and each group folds once (scale s, folded zero z = -zero * s):

    sum_k x_k (c_k s + z) = 16 s D + (z - 16 s) xs

Split-K as the Triton kernels do it (`w4a16_epilogue`): the warps of a CTA take different groups and meet in shared
memory; CTAs of a column block add fp32 partials into the self-cleaning workspace and the last one writes.

The CPU path and the test oracle is `mma_gemv_reference`: the same decode bits and the same fold in PyTorch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lmd.turbomind.kernels import nvrtc

BLOCK_N = 64  # output channels per CTA (a warp's four 16-row A tiles)
GROUPS = (32, 64, 128)  # group sizes the kernel takes (a group is whole k32 steps, unrolled)
BLOCK_MS = (8, 16, 32)  # token rows per CTA: n8 MMA blocks of 1, 2, 4 (more rows: more token tiles in the grid)


@dataclass(frozen=True)
class MmaGemvConfig:
    block_m: int = 8  # token rows a CTA covers: 8, 16 (one or two n8 MMA blocks, fold per group) or 32
    # (dequantized in registers); M past it runs as more token tiles
    warps: int = 4  # warps per CTA, each on its own groups of the CTA's K range
    groups_per_warp: int = 1  # K range of a CTA = warps * groups_per_warp groups (sets split-K)
    prefetch: bool = False  # load the warp's next group while computing this one (a register double buffer)
    word_decode: bool = True  # fp16: one shift per packed word, not one per nibble pair (bf16 always per pair)

    def name(self) -> str:
        return (f"mma-gemv m{self.block_m} w{self.warps} g{self.groups_per_warp} pf{int(self.prefetch)}"
                f"{'' if self.word_decode else ' pair'}")


def supports(n: int, k: int, group: int) -> bool:
    return n % BLOCK_N == 0 and group in GROUPS and k % group == 0


def enabled(device: torch.device) -> bool:
    """Whether the tuner offers this kernel: opt-in (`LMD_W4A16_MMA_GEMV=1`) until it has passed
    `benchmarks/w4a16_mma_gemv_probe.py` on a GPU, on CUDA devices where NVRTC works."""
    return os.environ.get("LMD_W4A16_MMA_GEMV") == "1" and device.type == "cuda" and nvrtc.available()


MAX_BUCKET = 128  # token tiles re-read the weights (from L2 at best): past 4 tiles the tensor-core GEMMs win


def tuner_configs(bucket: int, n: int, k: int, group: int) -> list[MmaGemvConfig]:
    """The configs the tuner times for one bucket of up to MAX_BUCKET rows."""
    if bucket > MAX_BUCKET or not supports(n, k, group):
        return []
    block_m = next((b for b in BLOCK_MS if b >= bucket), BLOCK_MS[-1])
    return [MmaGemvConfig(block_m, warps, per_warp, prefetch) for warps in (2, 4, 8) for per_warp in (1, 2, 4)
            for prefetch in (False, True) if not (prefetch and per_warp == 1)]


SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
struct U4 { u32 x, y, z, w; };

#if BF16
#define MMA_TYPE "bf16"
#define ONE2 0x3F803F80u
#else
#define MMA_TYPE "f16"
#define ONE2 0x3C003C00u
#endif

// WORD_DECODE (fp16): one shift per word; pairs (0,4), (2,6) read 16 + c/64, pairs (1,5), (3,7) read 1 + c/64,
// so the offsets' MMA takes 16.0 for fragment columns (2t, 2t + 1). Else one shift per pair; all read 1 + c/16.
#if WORD_DECODE
#define SCALE_C 64.f
#else
#define SCALE_C 16.f
#endif

// From 32 token rows on (MB >= 4) the per-group fold would need a second accumulator set: the weights are
// dequantized in registers instead, w = (v - offset) * (C s) + z in two packed ops, and the MMA sums over all groups.
#define SCALED (MB >= 4)

__device__ __forceinline__ U4 load_stream(const void* p) {  // weights: read once, evict first
    U4 r;
    asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ U4 load_cached(const void* p) {  // activations, scales, zeros: shared by many CTAs
    U4 r;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// (src & MASK) | magic in one LOP3: the mask as its immediate, the 1.0 / 16.0 bits in a register
template <u32 MASK>
__device__ __forceinline__ u32 and_or(u32 src, u32 magic) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(src), "n"(MASK), "r"(magic));
    return r;
}

// a register whose value the compiler cannot fold into an immediate (and then rematerialize at every use)
__device__ __forceinline__ u32 opaque(u32 v) {
    u32 r;
    asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(v));
    return r;
}

// nibbles I and I + 4 of word q (q8 = q >> 8) in the low and high half, as (offset + c / SCALE_C);
// one = the unit bits in both halves, sixteen = 16.0 in both halves (word decode only)
template <int I>
__device__ __forceinline__ u32 unit_pair(u32 q, u32 q8, u32 one, u32 sixteen) {
#if WORD_DECODE
    const u32 src = I < 2 ? q : q8;
    return I % 2 == 0 ? and_or<0x000F000Fu>(src, sixteen) : and_or<0x00F000F0u>(src, one);
#else
#if BF16
    constexpr int shift = 3 - 4 * I;  // the nibble into mantissa bits 3..6
    constexpr u32 mask = 0x00780078u;
#else
    constexpr int shift = 6 - 4 * I;  // mantissa bits 6..9
    constexpr u32 mask = 0x03C003C0u;
#endif
    const u32 t = shift >= 0 ? (q << (shift >= 0 ? shift : 0)) : (q >> (shift < 0 ? -shift : 0));
    return and_or<mask>(t, one);
#endif
}

// (v - offset) * cs + z on both halves: the subtraction is exact (it leaves c / C), the FMA rounds once
__device__ __forceinline__ u32 dequant(u32 v, u32 offset, u32 cs, u32 z) {
    u32 r;
#if BF16
    asm("{.reg .b32 t;\n sub.rn.bf16x2 t, %1, %2;\n fma.rn.bf16x2 %0, t, %3, %4;}"
        : "=r"(r) : "r"(v), "r"(offset), "r"(cs), "r"(z));
#else
    asm("{.reg .b32 t;\n sub.f16x2 t, %1, %2;\n fma.rn.f16x2 %0, t, %3, %4;}"
        : "=r"(r) : "r"(v), "r"(offset), "r"(cs), "r"(z));
#endif
    return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float to_float(u32 halves, int high) {
    const u16 h = high ? (u16)(halves >> 16) : (u16)(halves & 0xFFFF);
#if BF16
    float f;
    asm("mov.b32 %0, %1;" : "=f"(f) : "r"(((u32)h) << 16));
    return f;
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ u16 from_float(float f) {
    u16 h;
#if BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}

__device__ __forceinline__ u32 word(const U4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// what one group of a warp reads: GSTEPS k32 steps of packed words (two 16-byte loads a step), of x (one
// 16-byte load a step and token block), and the scales and zeros of the thread's 8 channels
struct Group {
    u32 q[GSTEPS][8];
#if !SCALED
    U4 x[MB][GSTEPS];
#endif
    U4 s, z;
};

// the weights' part (words, scales, zeros): nothing an earlier kernel writes, so it may be read before the PDL wait
__device__ __forceinline__ void load_weights(Group& d, const u32* qw, const u16* scales, const u16* zeros, int N,
                                             int gi, int t, int col) {
#pragma unroll
    for (int s = 0; s < GSTEPS; ++s) {
        const u32* p = qw + (u64)(gi * GSTEPS * 4 + s * 4 + t) * N + col;
        const U4 lo = load_stream(p), hi = load_stream(p + 4);
        d.q[s][0] = lo.x; d.q[s][1] = lo.y; d.q[s][2] = lo.z; d.q[s][3] = lo.w;
        d.q[s][4] = hi.x; d.q[s][5] = hi.y; d.q[s][6] = hi.z; d.q[s][7] = hi.w;
    }
    d.s = load_cached(scales + (u64)gi * N + col);
    d.z = load_cached(zeros + (u64)gi * N + col);
}

// x[m, k0 + 8t .. k0 + 8t + 7] for token row m of the thread (zeros past M)
__device__ __forceinline__ U4 load_x_step(const u16* x, int M, int K, int m, int k0, int t) {
    U4 r;
    if (m < M) {
        r = load_cached(x + (u64)m * K + k0 + 8 * t);
    } else {
        r.x = r.y = r.z = r.w = 0u;
    }
    return r;
}

__device__ __forceinline__ void load_x(Group& d, const u16* x, int M, int K, int gi, int g, int t) {
#if !SCALED
#pragma unroll
    for (int b = 0; b < MB; ++b) {
        const int m = b * 8 + g;
#pragma unroll
        for (int s = 0; s < GSTEPS; ++s) d.x[b][s] = load_x_step(x, M, K, m, gi * GSTEPS * 32 + s * 32, t);
    }
#endif
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
w4a16_mma_gemv(const u16* __restrict__ x, const u32* __restrict__ qw, const u16* __restrict__ scales,
               const u16* __restrict__ zeros, const u16* __restrict__ bias, u16* __restrict__ out,
               float* __restrict__ ws, int* __restrict__ counters, int rows, int N, int K, int groups_per_cta,
               int has_bias) {
    // grid: x = token tiles of MB * 8 rows (fastest, so that the tiles of one weight block run together and the
    // later ones find its words in L2), y = 64-channel blocks, z = K splits
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.x * MB * 8;
    const int M = rows - m0 < MB * 8 ? rows - m0 : MB * 8;  // token rows of this tile
    x += (u64)m0 * K;
    out += (u64)m0 * N;
    ws += (u64)m0 * N;
    const int tile = blockIdx.y * gridDim.x + blockIdx.x;  // the split-K counter of this (channels, tokens) tile
    const int col = blockIdx.y * 64 + 8 * g;  // the thread's 8 output channels: col .. col + 7
    const int groups = K / (GSTEPS * 32);
    const int first = blockIdx.z * groups_per_cta;
    const int end = first + groups_per_cta < groups ? first + groups_per_cta : groups;

    const u32 one = opaque(ONE2), sixteen = opaque(0x4C004C00u), offset_a = WORD_DECODE ? sixteen : one;
    float y[MB][4][4];
#pragma unroll
    for (int b = 0; b < MB; ++b)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) y[b][j][e] = 0.f;

    Group cur;
    if (first + warp < end) load_weights(cur, qw, scales, zeros, N, first + warp, t, col);
#if PDL
    // programmatic dependent launch: the first group's weights are in flight while the previous kernel finishes;
    // x is its output, read after the wait; the next kernel may be scheduled from here on (its own wait holds
    // back its reads of this kernel's output and of the split-K workspace)
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
    if (first + warp < end) load_x(cur, x, M, K, first + warp, g, t);
    for (int gi = first + warp; gi < end; gi += WARPS) {
        const bool more = gi + WARPS < end;
#if PREFETCH
        Group next;
        if (more) {
            load_weights(next, qw, scales, zeros, N, gi + WARPS, t, col);
            load_x(next, x, M, K, gi + WARPS, g, t);
        }
#endif
#if SCALED
        u32 cs2[8], z2[8];  // per channel of the thread: C s and z in both halves
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            cs2[e] = prmt(from_float(SCALE_C * to_float(word(cur.s, e >> 1), e & 1)), 0u, 0x1010);
            z2[e] = prmt(word(cur.z, e >> 1), 0u, e & 1 ? 0x3232 : 0x1010);
        }
#pragma unroll
        for (int s = 0; s < GSTEPS; ++s) {
            U4 xv[MB];
#pragma unroll
            for (int b = 0; b < MB; ++b) xv[b] = load_x_step(x, M, K, b * 8 + g, gi * GSTEPS * 32 + s * 32, t);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                u32 b0[MB], b1[MB];
#pragma unroll
                for (int b = 0; b < MB; ++b) {
                    const u32 lo = h ? xv[b].y : xv[b].x, hi = h ? xv[b].w : xv[b].z;
                    b0[b] = prmt(lo, hi, 0x5410);
                    b1[b] = prmt(lo, hi, 0x7632);
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const u32 w0 = cur.q[s][2 * j], w1 = cur.q[s][2 * j + 1], w08 = w0 >> 8, w18 = w1 >> 8;
                    // columns (2t, 2t + 1) hold pair 2h, whose offset is 16 under word decode; (2t + 8, ..) pair 2h + 1
                    const u32 a0 = dequant(h ? unit_pair<2>(w0, w08, one, sixteen) : unit_pair<0>(w0, w08, one, sixteen),
                                           offset_a, cs2[2 * j], z2[2 * j]);
                    const u32 a1 = dequant(h ? unit_pair<2>(w1, w18, one, sixteen) : unit_pair<0>(w1, w18, one, sixteen),
                                           offset_a, cs2[2 * j + 1], z2[2 * j + 1]);
                    const u32 a2 = dequant(h ? unit_pair<3>(w0, w08, one, sixteen) : unit_pair<1>(w0, w08, one, sixteen),
                                           one, cs2[2 * j], z2[2 * j]);
                    const u32 a3 = dequant(h ? unit_pair<3>(w1, w18, one, sixteen) : unit_pair<1>(w1, w18, one, sixteen),
                                           one, cs2[2 * j + 1], z2[2 * j + 1]);
#pragma unroll
                    for (int b = 0; b < MB; ++b) mma(y[b][j], a0, a1, a2, a3, b0[b], b1[b]);
                }
            }
        }
#else
        float d[MB][4][4], xs[MB][4];
#pragma unroll
        for (int b = 0; b < MB; ++b) {
#pragma unroll
            for (int e = 0; e < 4; ++e) xs[b][e] = 0.f;
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) d[b][j][e] = 0.f;
        }
#pragma unroll
        for (int s = 0; s < GSTEPS; ++s) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                u32 b0[MB], b1[MB];
#pragma unroll
                for (int b = 0; b < MB; ++b) {
                    const u32 lo = h ? cur.x[b][s].y : cur.x[b][s].x, hi = h ? cur.x[b][s].w : cur.x[b][s].z;
                    b0[b] = prmt(lo, hi, 0x5410);  // x[k0 + 8t + 2h], x[... + 2h + 4]
                    b1[b] = prmt(lo, hi, 0x7632);  // x[k0 + 8t + 2h + 1], x[... + 2h + 5]
                    mma(xs[b], offset_a, one, one, one, b0[b], b1[b]);
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const u32 w0 = cur.q[s][2 * j], w1 = cur.q[s][2 * j + 1], w08 = w0 >> 8, w18 = w1 >> 8;
                    const u32 a0 = h ? unit_pair<2>(w0, w08, one, sixteen) : unit_pair<0>(w0, w08, one, sixteen);
                    const u32 a1 = h ? unit_pair<2>(w1, w18, one, sixteen) : unit_pair<0>(w1, w18, one, sixteen);
                    const u32 a2 = h ? unit_pair<3>(w0, w08, one, sixteen) : unit_pair<1>(w0, w08, one, sixteen);
                    const u32 a3 = h ? unit_pair<3>(w1, w18, one, sixteen) : unit_pair<1>(w1, w18, one, sixteen);
#pragma unroll
                    for (int b = 0; b < MB; ++b) mma(d[b][j], a0, a1, a2, a3, b0[b], b1[b]);
                }
            }
        }
        // fold: d rows (g, g + 8) of tile j are channels col + 2j (elements 0, 1) and col + 2j + 1 (2, 3);
        // columns 2t, 2t + 1 are token rows. xs rows g hold the offsets' sum o, rows g + 8 the plain sum of x:
        // sum x (c s + z) = C s (d - o) + z xs
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int e = 2 * j + r;
                const float cs = SCALE_C * to_float(word(cur.s, e >> 1), e & 1);
                const float zr = to_float(word(cur.z, e >> 1), e & 1);
#pragma unroll
                for (int b = 0; b < MB; ++b) {
                    y[b][j][2 * r] += cs * (d[b][j][2 * r] - xs[b][0]);  // two FFMAs and a FADD
                    y[b][j][2 * r] += zr * xs[b][2];
                    y[b][j][2 * r + 1] += cs * (d[b][j][2 * r + 1] - xs[b][1]);
                    y[b][j][2 * r + 1] += zr * xs[b][3];
                }
            }
        }
#endif
#if PREFETCH
        cur = next;
#else
        if (more) {
            load_weights(cur, qw, scales, zeros, N, gi + WARPS, t, col);
            load_x(cur, x, M, K, gi + WARPS, g, t);
        }
#endif
    }

    __shared__ int last_cta;
#if SCALED
    // warps of the CTA meet in shared memory: red[token][channel], zeroed before the first add, added atomically
    __shared__ float red[MB * 8][64];
    for (int i = threadIdx.x; i < MB * 8 * 64; i += WARPS * 32) red[i >> 6][i & 63] = 0.f;
    __syncthreads();
#pragma unroll
    for (int b = 0; b < MB; ++b)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (b * 8 + 2 * t + (e & 1) < M)
                    atomicAdd(&red[b * 8 + 2 * t + (e & 1)][8 * g + 2 * j + (e >> 1)], y[b][j][e]);
    __syncthreads();
#else
    // warps of the CTA meet in shared memory: red[warp][token][channel], summed in warp order
    __shared__ float red[WARPS][MB * 8][64];
#pragma unroll
    for (int b = 0; b < MB; ++b)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                red[warp][b * 8 + 2 * t + (e & 1)][8 * g + 2 * j + (e >> 1)] = y[b][j][e];
    __syncthreads();
#endif
    const int split = gridDim.z > 1;
    for (int i = threadIdx.x; i < MB * 8 * 64; i += WARPS * 32) {
        const int m = i >> 6, c = i & 63;
        if (m >= M) continue;
#if SCALED
        float v = red[m][c];
#else
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += red[w][m][c];
#endif
        const int n = blockIdx.y * 64 + c;
        if (split) {
            atomicAdd(ws + (u64)m * N + n, v);
        } else {
            if (has_bias) v += to_float(bias[n], 0);
            out[(u64)m * N + n] = from_float(v);
        }
    }
    if (!split) return;
    // split-K: the last CTA of the column block reads the sum, zeroes the workspace, resets the counter
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_cta = atomicAdd(counters + tile, 1) == (int)gridDim.z - 1;
    __syncthreads();
    if (!last_cta) return;
    __threadfence();
    for (int i = threadIdx.x; i < MB * 8 * 64; i += WARPS * 32) {
        const int m = i >> 6, c = i & 63;
        if (m >= M) continue;
        const int n = blockIdx.y * 64 + c;
        float v = atomicExch(ws + (u64)m * N + n, 0.f);
        if (has_bias) v += to_float(bias[n], 0);
        out[(u64)m * N + n] = from_float(v);
    }
    if (threadIdx.x == 0) atomicExch(counters + tile, 0);
}
"""


def word_decode(dtype: torch.dtype, cfg: MmaGemvConfig) -> bool:
    """bf16's 7-bit mantissa cannot hold a nibble at bits 4..7, so bf16 decodes per pair whatever the config says."""
    return cfg.word_decode and dtype == torch.float16


def kernel_source(dtype: torch.dtype, group: int, cfg: MmaGemvConfig, pdl: bool = False) -> str:
    defines = {"BF16": int(dtype == torch.bfloat16), "MB": cfg.block_m // 8, "GSTEPS": group // 32,
               "WARPS": cfg.warps, "PREFETCH": int(cfg.prefetch), "WORD_DECODE": int(word_decode(dtype, cfg)),
               "PDL": int(pdl)}
    return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + SOURCE


def mma_gemv(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             bias: torch.Tensor | None, cfg: MmaGemvConfig) -> torch.Tensor:
    """x2d [M, K] -> [M, N] in x's dtype, on CUDA; M past cfg.block_m runs as token tiles of block_m rows."""
    from lmd.turbomind.kernels.pdl import pdl_enabled  # imports Triton, which the tuner has by now
    from lmd.turbomind.kernels.w4a16_epilogue import SplitKWorkspace

    m, k = x2d.shape
    n = qweight.shape[1]
    group = k // scales.shape[0]
    if cfg.block_m not in BLOCK_MS:
        raise ValueError(f"mma-gemv block_m={cfg.block_m}: one of {BLOCK_MS}")
    if not supports(n, k, group):
        raise ValueError(f"mma-gemv needs N % {BLOCK_N} == 0 and a group of {GROUPS}; got N={n}, group={group}")
    if any(t.data_ptr() % 16 or not t.is_contiguous() for t in (qweight, scales, zeros)):
        raise ValueError("mma-gemv reads qweight, scales and zeros as contiguous 16-byte vectors")
    if x2d.data_ptr() % 16:  # x likewise; a view at an odd offset is copied
        x2d = x2d.clone()
    groups = k // group
    per_cta = cfg.warps * cfg.groups_per_warp
    split = -(-groups // per_cta)
    token_tiles = -(-m // cfg.block_m)
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    ws, cnt = (SplitKWorkspace.get(x2d.device, m * n, token_tiles * (n // BLOCK_N)) if split > 1 else (out, out))
    pdl = pdl_enabled(x2d.device)
    kernel = nvrtc.compile_kernel(kernel_source(x2d.dtype, group, cfg, pdl), "w4a16_mma_gemv",
                                  torch.cuda.get_device_capability(x2d.device))
    nvrtc.launch(kernel, (token_tiles, n // BLOCK_N, split), (32 * cfg.warps, 1, 1),
                 [x2d, qweight, scales, zeros, bias if bias is not None else out, out, ws, cnt, m, n, k, per_cta,
                  int(bias is not None)], pdl=pdl)
    return out


def unit_values(qweight: torch.Tensor, dtype: torch.dtype, word: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's decode in PyTorch, built from the same shifts, masks and 1.0 bits: the value each nibble reads as
    and its offset (the value with c = 0), both [K/8, N, 8] in nibble order. Pair decode: 1 + c/16; word decode
    (fp16): 16 + c/64 for nibbles 0, 2, 4, 6, 1 + c/64 for the odd ones."""
    q = qweight.to(torch.int64) & 0xFFFFFFFF
    regs = []  # register I holds nibbles (I, I + 4)
    for i in range(4):
        if word:
            src = q if i < 2 else q >> 8
            regs.append((src & 0x000F000F) | 0x4C004C00 if i % 2 == 0 else (src & 0x00F000F0) | 0x3C003C00)
        else:
            bit, mask, one = (3, 0x00780078, 0x3F803F80) if dtype == torch.bfloat16 else (6, 0x03C003C0, 0x3C003C00)
            shift = bit - 4 * i
            t = ((q << shift) if shift >= 0 else (q >> -shift)) & 0xFFFFFFFF
            regs.append((t & mask) | one)
    halves = [r & 0xFFFF for r in regs] + [r >> 16 for r in regs]  # nibbles 0..3, then 4..7
    bits = torch.stack(halves, dim=-1).to(torch.int16)
    values = bits.view(torch.bfloat16 if dtype == torch.bfloat16 else torch.float16).to(torch.float32)
    offsets = torch.ones(8, dtype=torch.float32, device=qweight.device)
    if word:
        offsets[0::2] = 16.0
    return values, offsets.expand_as(values)


def mma_gemv_reference(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       cfg: MmaGemvConfig = MmaGemvConfig()) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch: per group, d = sum x v (v the decoded value), o = sum x offset(v) and
    xs = sum x in fp32, folded as C s (d - o) + z xs (C = 16 pair decode, 64 word decode). x2d [M, K] -> [M, N]."""
    m, k = x2d.shape
    n = qweight.shape[1]
    groups = scales.shape[0]
    group = k // groups
    word = word_decode(x2d.dtype, cfg)
    values, offsets = unit_values(qweight, x2d.dtype, word)

    def by_k(t: torch.Tensor) -> torch.Tensor:  # [K/8, N, 8] -> [G, group, N], row 8r + i = nibble i of row r
        return t.permute(0, 2, 1).reshape(groups, group, n)

    x = x2d.to(torch.float32).reshape(m, groups, group)
    d = torch.einsum("mgk,gkn->mgn", x, by_k(values))
    o = torch.einsum("mgk,gkn->mgn", x, by_k(offsets.contiguous()))
    xs = x.sum(dim=-1)[..., None]  # [M, G, 1]
    c = 64.0 if word else 16.0
    y = (c * scales.float() * (d - o) + zeros.float() * xs).sum(dim=1)
    return y.to(x2d.dtype)
