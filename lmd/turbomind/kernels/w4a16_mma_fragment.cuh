// The pieces the W4A16 CUDA kernels share (the mma.sync GEMV and GEMM, the wgmma GEMM): the nibble decode into MMA
// fragments, the dequant, the MMA itself, the split-K finish. Prepended to each kernel's source after its defines
// (BF16, WORD_DECODE); the fragment plan is drawn in w4a16_mma_gemv.py.
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
// C in both halves of a packed pair (bf16 never word-decodes)
#if BF16
#define SCALE_C2 0x41804180u
#elif WORD_DECODE
#define SCALE_C2 0x54005400u
#else
#define SCALE_C2 0x4C004C00u
#endif

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

// the B fragment of k16 step h from v = x[m, k0 + 8t .. k0 + 8t + 7] (the thread's token row m is the fragment's
// column g): b0 = (x[.. + 2h], x[.. + 2h + 4]), b1 = (x[.. + 2h + 1], x[.. + 2h + 5]), the k order of the nibbles
__device__ __forceinline__ void x_fragment(const U4& v, int h, u32& b0, u32& b1) {
    const u32 lo = h ? v.y : v.x, hi = h ? v.w : v.z;
    b0 = prmt(lo, hi, 0x5410);
    b1 = prmt(lo, hi, 0x7632);
}

// the A fragment of tile j at k16 step h, dequantized: q the thread's 8 words of the k32 step, cs2 and z2 its
// channels' (C s, z) in both halves. Columns (2t, 2t + 1) hold nibble pair 2h, read as offset_a + c / C (16 + c / 64
// under word decode), columns (2t + 8, 2t + 9) pair 2h + 1, read as 1 + c / C
__device__ __forceinline__ void dequant_tile(u32 (&a)[4], int h, int j, const u32* q, const u32* cs2, const u32* z2,
                                             u32 one, u32 sixteen, u32 offset_a) {
    units(a, h, q[2 * j], q[2 * j + 1], one, sixteen);
    a[0] = dequant(a[0], offset_a, cs2[2 * j], z2[2 * j]);
    a[1] = dequant(a[1], offset_a, cs2[2 * j + 1], z2[2 * j + 1]);
    a[2] = dequant(a[2], one, cs2[2 * j], z2[2 * j]);
    a[3] = dequant(a[3], one, cs2[2 * j + 1], z2[2 * j + 1]);
}

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// one k32 step of the dequantizing kernels: y[b][j] += A (tile j, dequantized) B (n8 block b) over both k16 steps;
// q the thread's 8 words, xv[b] its x row of block b (x[m, k0 + 8t ..]), cs2 and z2 as in dequant_tile
template <int BLOCKS>
__device__ __forceinline__ void dequant_mma_k32(float (&y)[BLOCKS][4][4], const u32* q, const U4 (&xv)[BLOCKS],
                                                const u32* cs2, const u32* z2, u32 one, u32 sixteen, u32 offset_a) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        u32 b0[BLOCKS], b1[BLOCKS];
#pragma unroll
        for (int b = 0; b < BLOCKS; ++b) x_fragment(xv[b], h, b0[b], b1[b]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            u32 a[4];
            dequant_tile(a, h, j, q, cs2, z2, one, sixteen, offset_a);
#pragma unroll
            for (int b = 0; b < BLOCKS; ++b) mma(y[b][j], a[0], a[1], a[2], a[3], b0[b], b1[b]);
        }
    }
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

// The thread's 8 channels are two runs of 4, col .. col + 3 and col + 32 .. col + 35 (col = block start + 4g): each
// 16-byte load of the warp then reads whole 128-byte rows (lanes g = 0..7), no sector split between two loads.
__device__ __forceinline__ int channel(int e) { return e < 4 ? e : 28 + e; }  // word e's channel, from col

// split-K (w4a16_epilogue's protocol): once each of an output tile's `contributors` has added its fp32 partials into
// its workspace tile, the last one to bump the tile's counter writes the M x cols outputs (+ bias[n0 ..]) from the
// sum, zeroes the workspace tile and resets the counter, so both are all-zero between launches. ws and out point at
// the tile's first element, rows ws_pitch and out_pitch elements apart. The `threads` taking part are numbered
// `thread` from 0 and meet at BARRIER: 0 is __syncthreads (the whole CTA), else the named barrier of that id.
template <int BARRIER>
__device__ __forceinline__ void finish_split_k(float* ws, int ws_pitch, int* counter, u16* out, int out_pitch,
                                               const u16* bias, int has_bias, int n0, int M, int cols,
                                               int contributors, int thread, int threads) {
    __shared__ int last_contributor;
    __threadfence();
    if (BARRIER == 0) __syncthreads(); else asm volatile("bar.sync %0, %1;" ::"n"(BARRIER), "r"(threads) : "memory");
    if (thread == 0) last_contributor = atomicAdd(counter, 1) == contributors - 1;
    if (BARRIER == 0) __syncthreads(); else asm volatile("bar.sync %0, %1;" ::"n"(BARRIER), "r"(threads) : "memory");
    if (!last_contributor) return;
    __threadfence();
    for (int i = thread; i < M * cols; i += threads) {
        const int m = i / cols, c = i % cols;
        float v = atomicExch(ws + (u64)m * ws_pitch + c, 0.f);
        if (has_bias) v += to_float(bias[n0 + c], 0);
        out[(u64)m * out_pitch + c] = from_float(v);
    }
    if (thread == 0) atomicExch(counter, 0);
}
