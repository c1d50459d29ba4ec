// W4A16 on mma.sync for 1-128 token rows. The design, the fragment plan and the invariants: w4a16_mma_gemv.py.
// Compiled at run time by NVRTC with the defines kernel_source() prepends (BF16, MB, GSTEPS, WARPS, PREFETCH,
// WORD_DECODE, PDL); tests/turbomind/kernels/mma_gemv_lanes.py emulates it lane by lane.
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

// weights: read-only for the kernel's life, kept out of L1 (read once per CTA); L2 keeps them for the next token tile
__device__ __forceinline__ U4 load_weight(const void* p) {
    U4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ void load_weight_pair(const void* p, u32& a, u32& b) {  // 8 bytes, as load_weight
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
}

// x: the previous kernel's output, which under PDL may still be in flight when this kernel starts, so an ordinary
// (coherent) load after griddepcontrol.wait, never the non-coherent path
__device__ __forceinline__ U4 load_activation(const void* p) {
    U4 r;
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
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

// the A fragment of one tile at k16 step h from its rows' words w0 (row g) and w1 (row g + 8): registers 0, 1 hold
// nibble pair 2h (fragment columns 2t, 2t + 1), registers 2, 3 pair 2h + 1 (columns 2t + 8, 2t + 9)
__device__ __forceinline__ void units(u32 (&a)[4], int h, u32 w0, u32 w1, u32 one, u32 sixteen) {
    const u32 w08 = w0 >> 8, w18 = w1 >> 8;
    if (h) {
        a[0] = unit_pair<2>(w0, w08, one, sixteen);
        a[1] = unit_pair<2>(w1, w18, one, sixteen);
        a[2] = unit_pair<3>(w0, w08, one, sixteen);
        a[3] = unit_pair<3>(w1, w18, one, sixteen);
    } else {
        a[0] = unit_pair<0>(w0, w08, one, sixteen);
        a[1] = unit_pair<0>(w1, w18, one, sixteen);
        a[2] = unit_pair<1>(w0, w08, one, sixteen);
        a[3] = unit_pair<1>(w1, w18, one, sixteen);
    }
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

// The thread's 8 channels are two runs of 4, col .. col + 3 and col + 32 .. col + 35 (col = block start + 4g): each
// 16-byte load of the warp then reads whole 128-byte rows (lanes g = 0..7), no sector split between two loads.
__device__ __forceinline__ int channel(int e) { return e < 4 ? e : 28 + e; }  // word e's channel, from col

// the weights' part (words, scales, zeros): nothing an earlier kernel writes, so it may be read before the PDL wait
__device__ __forceinline__ void load_weights(Group& d, const u32* qw, const u16* scales, const u16* zeros, int N,
                                             int gi, int t, int col) {
#pragma unroll
    for (int s = 0; s < GSTEPS; ++s) {
        const u32* p = qw + (u64)(gi * GSTEPS * 4 + s * 4 + t) * N + col;
        const U4 lo = load_weight(p), hi = load_weight(p + 32);
        d.q[s][0] = lo.x; d.q[s][1] = lo.y; d.q[s][2] = lo.z; d.q[s][3] = lo.w;
        d.q[s][4] = hi.x; d.q[s][5] = hi.y; d.q[s][6] = hi.z; d.q[s][7] = hi.w;
    }
    load_weight_pair(scales + (u64)gi * N + col, d.s.x, d.s.y);
    load_weight_pair(scales + (u64)gi * N + col + 32, d.s.z, d.s.w);
    load_weight_pair(zeros + (u64)gi * N + col, d.z.x, d.z.y);
    load_weight_pair(zeros + (u64)gi * N + col + 32, d.z.z, d.z.w);
}

// x[m, k0 + 8t .. k0 + 8t + 7] for token row m of the thread (zeros past M)
__device__ __forceinline__ U4 load_x_step(const u16* x, int M, int K, int m, int k0, int t) {
    U4 r;
    if (m < M) {
        r = load_activation(x + (u64)m * K + k0 + 8 * t);
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
    const int col = blockIdx.y * 64 + 4 * g;  // the thread's 8 output channels: col + channel(0 .. 7)
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
        U4 xv[MB], xn[MB];  // this step's x and the next one's, loaded a step ahead
#pragma unroll
        for (int b = 0; b < MB; ++b) xv[b] = load_x_step(x, M, K, b * 8 + g, gi * GSTEPS * 32, t);
#pragma unroll
        for (int s = 0; s < GSTEPS; ++s) {
            if (s + 1 < GSTEPS) {
#pragma unroll
                for (int b = 0; b < MB; ++b)
                    xn[b] = load_x_step(x, M, K, b * 8 + g, gi * GSTEPS * 32 + s * 32 + 32, t);
            }
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
                    u32 a[4];
                    units(a, h, cur.q[s][2 * j], cur.q[s][2 * j + 1], one, sixteen);
                    // columns (2t, 2t + 1) hold pair 2h (offset 16 under word decode), (2t + 8, ..) pair 2h + 1
                    a[0] = dequant(a[0], offset_a, cs2[2 * j], z2[2 * j]);
                    a[1] = dequant(a[1], offset_a, cs2[2 * j + 1], z2[2 * j + 1]);
                    a[2] = dequant(a[2], one, cs2[2 * j], z2[2 * j]);
                    a[3] = dequant(a[3], one, cs2[2 * j + 1], z2[2 * j + 1]);
#pragma unroll
                    for (int b = 0; b < MB; ++b) mma(y[b][j], a[0], a[1], a[2], a[3], b0[b], b1[b]);
                }
            }
            if (s + 1 < GSTEPS) {
#pragma unroll
                for (int b = 0; b < MB; ++b) xv[b] = xn[b];
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
                    u32 a[4];
                    units(a, h, cur.q[s][2 * j], cur.q[s][2 * j + 1], one, sixteen);
#pragma unroll
                    for (int b = 0; b < MB; ++b) mma(d[b][j], a[0], a[1], a[2], a[3], b0[b], b1[b]);
                }
            }
        }
        // fold: d rows (g, g + 8) of tile j are words 2j (elements 0, 1) and 2j + 1 (2, 3);
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
        if (more) cur = next;
#else
        if (more) {
            load_weights(cur, qw, scales, zeros, N, gi + WARPS, t, col);
            load_x(cur, x, M, K, gi + WARPS, g, t);
        }
#endif
    }

    __shared__ int last_cta;
    // warps of the CTA meet in shared memory: SCALED red[token][channel], zeroed first and added atomically (32 rows
    // of every warp would not fit side by side); else red[warp][token][channel], summed in warp order below
#if SCALED
    __shared__ float red[MB * 8][64];
    for (int i = threadIdx.x; i < MB * 8 * 64; i += WARPS * 32) red[i >> 6][i & 63] = 0.f;
    __syncthreads();
#else
    __shared__ float red[WARPS][MB * 8][64];
#endif
#pragma unroll
    for (int b = 0; b < MB; ++b)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = b * 8 + 2 * t + (e & 1), c = 4 * g + channel(2 * j + (e >> 1));
#if SCALED
                if (m < M) atomicAdd(&red[m][c], y[b][j][e]);
#else
                red[warp][m][c] = y[b][j][e];
#endif
            }
    __syncthreads();
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
