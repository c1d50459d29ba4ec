// W4A16 on mma.sync for 1-128 token rows. The design, the fragment plan and the invariants: w4a16_mma_gemv.py.
// Compiled at run time by NVRTC with the defines kernel_source() prepends (BF16, MB, GSTEPS, WARPS, PREFETCH,
// STAGES, STAGE_BYTES, WORD_DECODE, PDL), w4a16_mma_fragment.cuh (the decode and MMA helpers) and
// cuda_pipeline.cuh (cp.async); tests/turbomind/kernels/mma_gemv_lanes.py emulates it lane by lane.

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
        const U4 lo = load_weight(p), hi = load_weight(p + 32);
        d.q[s][0] = lo.x; d.q[s][1] = lo.y; d.q[s][2] = lo.z; d.q[s][3] = lo.w;
        d.q[s][4] = hi.x; d.q[s][5] = hi.y; d.q[s][6] = hi.z; d.q[s][7] = hi.w;
    }
    load_weight_pair(scales + (u64)gi * N + col, d.s.x, d.s.y);
    load_weight_pair(scales + (u64)gi * N + col + 32, d.s.z, d.s.w);
    load_weight_pair(zeros + (u64)gi * N + col, d.z.x, d.z.y);
    load_weight_pair(zeros + (u64)gi * N + col + 32, d.z.z, d.z.w);
}

#if STAGES && PREFETCH
#error "STAGES replaces the register double buffer PREFETCH: not both"
#endif

#if STAGES
// STAGES > 0: a warp's next groups stream into shared memory by cp.async, STAGES of them in flight, so the bytes in
// flight are not bounded by registers. A stage holds one group as its lanes load it: slot (s, half) of the words is
// 32 lanes x 16 bytes, then scales low/high and zeros low/high, 32 lanes x 8 bytes each. Each lane copies and reads
// back only its own slots, so its cp.async.wait_group alone orders its copies before its reads (no barrier).
// STAGE_BYTES, defined by kernel_source(), is GSTEPS * 2 * 512 + 4 * 256.

__device__ __forceinline__ void copy8(u32 dst, const void* src) {  // 8 bytes global -> shared (cp.async.cg is 16 only)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src));
}

// the weights' part of load_weights, into a stage
__device__ __forceinline__ void copy_weights(u32 stage, const u32* qw, const u16* scales, const u16* zeros, int N,
                                             int gi, int t, int col, int lane) {
#pragma unroll
    for (int s = 0; s < GSTEPS; ++s) {
        const u32* p = qw + (u64)(gi * GSTEPS * 4 + s * 4 + t) * N + col;
        copy16(stage + (2 * s) * 512 + lane * 16, p, true);
        copy16(stage + (2 * s + 1) * 512 + lane * 16, p + 32, true);
    }
    const u32 sz = stage + GSTEPS * 2 * 512 + lane * 8;
    copy8(sz, scales + (u64)gi * N + col);
    copy8(sz + 256, scales + (u64)gi * N + col + 32);
    copy8(sz + 512, zeros + (u64)gi * N + col);
    copy8(sz + 768, zeros + (u64)gi * N + col + 32);
}

__device__ __forceinline__ void read_weights(Group& d, u32 stage, int lane) {
#pragma unroll
    for (int s = 0; s < GSTEPS; ++s) {
        const U4 lo = lds128(stage + (2 * s) * 512 + lane * 16), hi = lds128(stage + (2 * s + 1) * 512 + lane * 16);
        d.q[s][0] = lo.x; d.q[s][1] = lo.y; d.q[s][2] = lo.z; d.q[s][3] = lo.w;
        d.q[s][4] = hi.x; d.q[s][5] = hi.y; d.q[s][6] = hi.z; d.q[s][7] = hi.w;
    }
    const u32 sz = stage + GSTEPS * 2 * 512 + lane * 8;
    lds64(sz, d.s.x, d.s.y);
    lds64(sz + 256, d.s.z, d.s.w);
    lds64(sz + 512, d.z.x, d.z.y);
    lds64(sz + 768, d.z.z, d.z.w);
}
#endif

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
    float y[MB][4][4] = {};  // n8 block b, weight tile j

#if STAGES
    // the warp's groups are first + warp + j WARPS, j = 0, 1, ...; group j goes into stage j % STAGES. The first
    // STAGES are asked for before the PDL wait (one commit group each, empty past the warp's last group)
    extern __shared__ __align__(16) unsigned char stage_memory[];
    const u32 warp_stages = smem_address(stage_memory) + warp * (STAGES * STAGE_BYTES);  // this warp's
#pragma unroll
    for (int j = 0; j < STAGES; ++j) {
        const int gi = first + warp + j * WARPS;
        if (gi < end) copy_weights(warp_stages + j * STAGE_BYTES, qw, scales, zeros, N, gi, t, col, lane);
        commit();
    }
    Group cur;
#else
    Group cur;
    if (first + warp < end) load_weights(cur, qw, scales, zeros, N, first + warp, t, col);
#endif
#if PDL
    // programmatic dependent launch: the first group's weights are in flight while the previous kernel finishes;
    // x is its output, read after the wait; the next kernel may be scheduled from here on (its own wait holds
    // back its reads of this kernel's output and of the split-K workspace)
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
#if STAGES
    for (int gi = first + warp, j = 0; gi < end; gi += WARPS, ++j) {
        const u32 stage = warp_stages + (j % STAGES) * STAGE_BYTES;
        wait_stages<STAGES - 1>();  // of the STAGES newest commit groups, the oldest (group j) has landed
        read_weights(cur, stage, lane);
        load_x(cur, x, M, K, gi, g, t);
#else
    if (first + warp < end) load_x(cur, x, M, K, first + warp, g, t);
    for (int gi = first + warp; gi < end; gi += WARPS) {
        const bool more = gi + WARPS < end;
#endif
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
            dequant_mma_k32(y, cur.q[s], xv, cs2, z2, one, sixteen, offset_a);
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
                    x_fragment(cur.x[b][s], h, b0[b], b1[b]);
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
#if STAGES
        // the stage read above is free: its shared loads were issued before this copy (volatile asm keeps program
        // order), and a cp.async writes shared memory only after its global read returns. Group j + STAGES goes into
        // it (an empty commit group past the warp's last).
        if (gi + STAGES * WARPS < end) copy_weights(stage, qw, scales, zeros, N, gi + STAGES * WARPS, t, col, lane);
        commit();
#elif PREFETCH
        if (more) cur = next;
#else
        if (more) {
            load_weights(cur, qw, scales, zeros, N, gi + WARPS, t, col);
            load_x(cur, x, M, K, gi + WARPS, g, t);
        }
#endif
    }
#if STAGES
    wait_stages<0>();  // (only empty commit groups are left; no copy may be writing shared memory at exit)
#endif

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
    if (split)
        finish_split_k<0>(ws + blockIdx.y * 64, N, counters + tile, out + blockIdx.y * 64, N, bias, has_bias,
                          blockIdx.y * 64, M, 64, gridDim.z, threadIdx.x, WARPS * 32);
}
