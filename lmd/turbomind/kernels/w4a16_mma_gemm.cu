// W4A16 GEMM on mma.sync for 16 token rows and more. The design, the shared-memory layout and its invariants:
// w4a16_mma_gemm.py. Compiled at run time by NVRTC after the defines kernel_source() prepends (BF16, WARPS_N,
// WARPS_M, MB, STAGES, GROUP, WORD_DECODE, PDL), w4a16_mma_fragment.cuh and cuda_pipeline.cuh;
// tests/turbomind/kernels/mma_gemm_lanes.py emulates it lane by lane.

#define BN (64 * WARPS_N)         // output channels of a CTA: 64 a warp (the fragment plan's four 16-row tiles)
#define BM (8 * MB * WARPS_M)     // token rows of a CTA: MB n8 blocks a warp
#define THREADS (32 * WARPS_N * WARPS_M)
#define BK 64                     // k of one pipeline stage: two k32 steps
#define SROWS (GROUP < BK ? BK / GROUP : 1)  // scale (and zero) rows a stage covers

// one stage in shared memory: packed words [8][BN] u32, x [BM][BK] halves, scales [SROWS][BN], zeros [SROWS][BN]
#define W_BYTES (8 * BN * 4)
#define X_BYTES (BM * BK * 2)
#define S_BYTES (SROWS * BN * 2)
#define STAGE_BYTES (W_BYTES + X_BYTES + 2 * S_BYTES)

// Swizzles (16-byte chunk indices; XOR with at most 6 or 4 keeps a chunk inside its 128-byte line). A warp's
// 16-byte shared loads go in phases of 8 lanes (g = 2p, 2p + 1; t = 0..3) that must hit 8 different chunks of a line:
//   words: lane (g, t) reads row 4s + t, chunk 16 wn + g (and + 8); the rows are BN * 4 bytes apart, a multiple of
//          128, so chunk c of row r lives at c ^ 2 (r & 3): g = 2p gives 2p ^ {0, 2, 4, 6}, g = 2p + 1 the odd rest
//   x:     lane (g, t) reads token row m (= g mod 2 in parity), chunk 4s + t; rows are 128 bytes apart, so chunk c of
//          row m lives at c ^ 4 (m & 1): the two rows of a phase take the two halves of the line
__device__ __forceinline__ int w_chunk(int row, int c) { return c ^ ((row & 3) << 1); }
__device__ __forceinline__ int x_chunk(int row, int c) { return c ^ ((row & 1) << 2); }

// A thread's share of every stage's copies, fixed for the kernel's life (the k tile moves the global side, the
// stage the shared side). THREADS is a multiple of both BN / 4 (chunks in a word row) and 8 (chunks in an x row),
// so a thread keeps its chunk column c and its rows advance by constant steps:
//   words: rows r0 + u W_STEP (u < W_PER; W_STEP = 2 WARPS_M, a multiple of 4 unless WARPS_M = 1, where odd u
//          flip bit 1 of r & 3, i.e. the swizzle's 4 in the chunk)
//   x:     rows m0 + u X_STEP (X_STEP = THREADS / 8, even: the row parity, so the swizzle, is the thread's)
//   scales and zeros: one chunk for the first 2 SROWS BN / 8 threads
#define W_STEP (THREADS / (BN / 4))
#define W_PER ((8 + W_STEP - 1) / W_STEP)
#define X_STEP (THREADS / 8)
#define X_PER ((BM + X_STEP - 1) / X_STEP)
#define S_CHUNKS (2 * SROWS * (BN / 8))
struct Copier {
    const u32* w_src;  // word row r0, column c, at k tile 0
    const u16* x_src;  // x row m0 (row 0 if m0 is past M), column 8c, at k tile 0
    const u16* s_src;  // scale or zero row 0, column 8c
    u64 w_stride, x_stride;  // elements between a thread's rows
    u32 w_dst, x_dst, s_dst;  // shared offsets within a stage of the first copies
    int w_row, x_row, s_row;  // r0, m0, the scale row within the stage (-1: no scale chunk)
};

__device__ __forceinline__ Copier make_copier(const u32* qw, const u16* x, const u16* scales, const u16* zeros,
                                              int M, int N, int K, int n0) {
    Copier cp;
    const int tid = threadIdx.x;
    const int wc = tid % (BN / 4);
    cp.w_row = tid / (BN / 4);
    cp.w_src = qw + (u64)cp.w_row * N + n0 + 4 * wc;
    cp.w_stride = (u64)W_STEP * N;
    cp.w_dst = cp.w_row * BN * 4 + w_chunk(cp.w_row, wc) * 16;
    const int xc = tid % 8;
    cp.x_row = tid / 8;
    cp.x_src = x + (u64)(cp.x_row < M ? cp.x_row : 0) * K + 8 * xc;
    cp.x_stride = (u64)X_STEP * K;
    cp.x_dst = W_BYTES + cp.x_row * BK * 2 + x_chunk(cp.x_row, xc) * 16;
    const int which = tid / (SROWS * (BN / 8)), sc = tid % (BN / 8);
    cp.s_row = tid < S_CHUNKS ? (tid / (BN / 8)) % SROWS : -1;
    cp.s_src = (which ? zeros : scales) + n0 + 8 * sc;
    cp.s_dst = W_BYTES + X_BYTES + which * S_BYTES + (cp.s_row > 0 ? cp.s_row : 0) * BN * 2 + sc * 16;
    return cp;
}

// the weights' part of k tile kt (words, scales, zeros) into the stage at shared address `stage`: nothing an earlier
// kernel writes, so it may go before the PDL wait
__device__ __forceinline__ void copy_weights(const Copier& cp, u32 stage, int N, int kt) {
    const u32* src = cp.w_src + (u64)kt * 8 * N;
#pragma unroll
    for (int u = 0; u < W_PER; ++u) {
        const u32 flip = W_STEP % 4 == 0 || u % 2 == 0 ? 0 : 64;  // see Copier
        if (W_STEP * W_PER == 8 || cp.w_row + u * W_STEP < 8)
            copy16(stage + ((cp.w_dst + u * W_STEP * BN * 4) ^ flip), src + u * cp.w_stride, true);
    }
    if (cp.s_row >= 0) copy16(stage + cp.s_dst, cp.s_src + (u64)((kt * BK + cp.s_row * 32) / GROUP) * N, true);
}

// x's part of k tile kt: rows past M zero-filled (their source is the tile's row 0, never read)
__device__ __forceinline__ void copy_x(const Copier& cp, u32 stage, int M, int kt) {
#pragma unroll
    for (int u = 0; u < X_PER; ++u) {
        const int m = cp.x_row + u * X_STEP;
        if (X_STEP * X_PER == BM || m < BM) {
            const bool valid = m < M;
            copy16(stage + cp.x_dst + u * X_STEP * BK * 2, cp.x_src + (valid ? u * cp.x_stride : 0) + kt * BK, valid);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
w4a16_mma_gemm(const u16* __restrict__ x, const u32* __restrict__ qw, const u16* __restrict__ scales,
               const u16* __restrict__ zeros, const u16* __restrict__ bias, u16* __restrict__ out,
               float* __restrict__ ws, int* __restrict__ counters, int rows, int N, int K, int tiles_per_split,
               int has_bias) {
    // grid: x = token tiles of BM rows (fastest: the tiles of one weight block run together, the later ones find
    // its words in L2), y = BN-channel blocks, z = K splits of tiles_per_split k tiles each
    extern __shared__ __align__(128) char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wn = warp % WARPS_N, wm = warp / WARPS_N;
    const int m0 = blockIdx.x * BM;
    const int M = rows - m0 < BM ? rows - m0 : BM;
    x += (u64)m0 * K;
    out += (u64)m0 * N;
    ws += (u64)m0 * N;
    const int n0 = blockIdx.y * BN;
    const int tile = blockIdx.y * gridDim.x + blockIdx.x;
    const int ktiles = K / BK;
    const int first = blockIdx.z * tiles_per_split;
    const int count = (first + tiles_per_split < ktiles ? first + tiles_per_split : ktiles) - first;
    const Copier cp = make_copier(qw, x, scales, zeros, M, N, K, n0);
    const u32 base = smem_address(smem), end = base + STAGES * STAGE_BYTES;

    // pipeline: the stage at `base + (i % STAGES) STAGE_BYTES` holds k tile first + i; one commit group per stage,
    // in order. The prologue's weights (before the PDL wait) fall into the first group, so waiting for group i
    // covers them too.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < count) copy_weights(cp, base + s * STAGE_BYTES, N, first + s);
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < count) copy_x(cp, base + s * STAGE_BYTES, M, first + s);
        commit();
    }

    const u32 one = opaque(ONE2), sixteen = opaque(0x4C004C00u), offset_a = WORD_DECODE ? sixteen : one;
    // C s in the activation dtype: finite while |s| < 1024 (weights under 15,360 in magnitude)
    const u32 scale_c2 = SCALE_C2;
    float y[MB][4][4] = {};  // n8 block b, weight tile j

    // the thread's shared offsets within a stage: its words at k32 step 0 (row t, chunks 16 wn + g and + 8, i.e.
    // + 128 bytes; step 1 is row 4 + t, the same swizzle), its x row g of n8 block 0 at both steps (chunk 4s + t;
    // block b: + 8 rows, the same parity), its scales (channels 64 wn + 4g .. and + 32: + 64 bytes)
    const u32 w_at = t * BN * 4 + w_chunk(t, 16 * wn + g) * 16;
    const int xrow = wm * MB * 8 + g;
    const u32 x_at0 = W_BYTES + xrow * BK * 2 + x_chunk(xrow, t) * 16;
    const u32 x_at1 = W_BYTES + xrow * BK * 2 + x_chunk(xrow, 4 + t) * 16;
    const u32 s_at = W_BYTES + X_BYTES + (64 * wn + 4 * g) * 2;
    u32 read = base, write = base + (STAGES - 1) * STAGE_BYTES;  // the stages of k tiles i and i + STAGES - 1
    for (int i = 0; i < count; ++i) {
        wait_stages<STAGES - 2>();  // stage i has landed (for this thread)...
        __syncthreads();  // ... for every thread, and all are done with stage i - 1, which the next copies refill
        if (i + STAGES - 1 < count) {
            copy_weights(cp, write, N, first + i + STAGES - 1);
            copy_x(cp, write, M, first + i + STAGES - 1);
        }
        commit();  // an empty group past the end keeps the count of pending groups right
        write = write + STAGE_BYTES == end ? base : write + STAGE_BYTES;

        u32 cs2[8], z2[8];  // per channel of the thread: C s and z in both halves
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            if (s == 0 || SROWS == 2) {
                const u32 at = read + s_at + (SROWS == 2 ? s : 0) * BN * 2;
                u32 sw[4], zw[4];
                lds64(at, sw[0], sw[1]);
                lds64(at + 64, sw[2], sw[3]);
                lds64(at + S_BYTES, zw[0], zw[1]);
                lds64(at + S_BYTES + 64, zw[2], zw[3]);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const u32 sel = e & 1 ? 0x3232 : 0x1010;
                    cs2[e] = hmul2(prmt(sw[e >> 1], 0u, sel), scale_c2);
                    z2[e] = prmt(zw[e >> 1], 0u, sel);
                }
            }
            const u32 w_step = read + w_at + s * 4 * BN * 4;
            const U4 lo = lds128(w_step), hi = lds128(w_step + 128);
            const u32 q[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
            U4 xv[MB];
#pragma unroll
            for (int b = 0; b < MB; ++b) xv[b] = lds128(read + (s ? x_at1 : x_at0) + b * 8 * BK * 2);
            dequant_mma_k32(y, q, xv, cs2, z2, one, sixteen, offset_a);
        }
        read = read + STAGE_BYTES == end ? base : read + STAGE_BYTES;
    }
    wait_stages<0>();  // no copy may still be writing shared memory when the CTA exits

    // D of tile j, block b: rows g, g + 8 are channels ch, ch + 1 (ch = n0 + 64 wn + 4g + channel(2j)), columns
    // 2t, 2t + 1 token rows: elements (0, 2) one token's channel pair, (1, 3) the next token's
    const int split = gridDim.z > 1;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int ch = n0 + 64 * wn + 4 * g + channel(2 * j);
        float b_lo = 0.f, b_hi = 0.f;
        if (has_bias && !split) {
            b_lo = to_float(bias[ch], 0);
            b_hi = to_float(bias[ch + 1], 0);
        }
#pragma unroll
        for (int b = 0; b < MB; ++b) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int m = wm * MB * 8 + 8 * b + 2 * t + r;
                if (m >= M) continue;
                if (split) {
                    atomicAdd(ws + (u64)m * N + ch, y[b][j][r]);
                    atomicAdd(ws + (u64)m * N + ch + 1, y[b][j][r + 2]);
                } else {
                    const u32 lo = from_float(y[b][j][r] + b_lo), hi = from_float(y[b][j][r + 2] + b_hi);
                    const u32 pair = lo | (hi << 16);
                    *(u32*)(out + (u64)m * N + ch) = pair;
                }
            }
        }
    }
    if (split)
        finish_split_k<0>(ws + n0, N, counters + tile, out + n0, N, bias, has_bias, n0, M, BN, gridDim.z,
                          threadIdx.x, THREADS);
}
