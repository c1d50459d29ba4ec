// W4A16 GEMM on Hopper's warpgroup MMA (wgmma, sm_90a) with the int4 decode overlapped: one producer thread copies
// packed words, scales and zeros (bulk copies) and x (a TMA box, 128-byte swizzle) into shared memory; SS: the
// producer warpgroup dequantizes each k tile into an fp16/bf16 A tile, RS: the two consumer warpgroups decode their
// A fragments into registers themselves; the consumers run wgmma; stream-K over the CTAs. Design and invariants:
// w4a16_wgmma.py. Compiled at run time by NVRTC after the defines kernel_source() prepends (BF16, WORD_DECODE, BN,
// BT, STAGES, GROUP, PDL, CTAS_PER_SM, RS, RS_DEPTH, the stage layout), w4a16_mma_fragment.cuh, cuda_pipeline.cuh and
// wgmma_tile (the wgmma statement for n = BT); tests/turbomind/kernels/wgmma_lanes.py emulates it,
// test_wgmma_pipeline_protocol.py models its barriers.

#define THREADS 384               // warpgroup 0: producer; 1, 2: consumers
#define BK 64                     // k of one stage
#define SLICES (BN / 128)         // 64-channel wgmma slices of a consumer warpgroup
#define SROWS (GROUP < BK ? BK / GROUP : 1)
// k tiles whose copies are in flight ahead of the one the consumers take next: the whole ring but the stage they
// hold (RS), or but two (the producer also dequantizes tile i while the consumers hold tile i - 1's stage)
#define PREFETCH (RS ? STAGES - 1 : STAGES - 2)
// registers a thread: the consumers hold BT / 2 accumulators a slice, the producer little. One CTA an SM: 168 at
// launch, then 128 x 88 + 256 x 208 <= 65536; two (CTAS_PER_SM 2, the small tile): 80, then 128 x 56 + 256 x 88 <=
// 384 x 80 (setmaxnreg moves them once the warpgroups part)
#if CTAS_PER_SM == 2
#define PRODUCER_REGISTERS 56
#define CONSUMER_REGISTERS 88
#else
#define PRODUCER_REGISTERS 88
#define CONSUMER_REGISTERS 208
#endif

// one stage (the offsets and its size come with the defines, from stage_layout() in the .py): x [BT][64] at
// X_OFFSET in the 128-byte swizzle, then (not under RS) the dequantized A tile, raw words [8][BN] u32 at
// RAW_OFFSET, scales [SROWS][BN] halves at SC_OFFSET, zeros SC_BYTES after them. STAGE_BYTES is whole 1024-byte
// swizzle atoms, so that every stage's x starts on one.
// x: token m's 64 k are the 128-byte row m (atom m / 8, row m % 8 of it), its 16-byte chunk c at c ^ (m % 8), as
// the TMA unit writes a box of a 128-byte-swizzle tensor map; wgmma reads it through a descriptor of the same
// swizzle, which applies the same XOR (address bits 4-6 with 7-9).

// A: wgmma's canonical K-major layout without swizzle, 8 x 8 core matrices of 128 contiguous bytes (8 rows of 16
// bytes, 8 k each), core (row / 8, k / 8) at (row / 8) * CORE_SBO + (k / 8) * CORE_LBO
#define CORE_LBO 128              // between core matrices adjacent in k
#define CORE_SBO 1024             // between core matrices adjacent in rows (8 of them cover the stage's 64 k)

__device__ __forceinline__ u32 core_offset(int row, int k8) {  // k8: the 8-wide k chunk within the stage
    return (row >> 3) * CORE_SBO + k8 * CORE_LBO + (row & 7) * 16;
}

__device__ __forceinline__ void producers_sync() { asm volatile("bar.sync 1, 128;" ::: "memory"); }

// The copies are the TMA unit's, issued by one producer thread: each completes as transaction bytes on the stage's
// full mbarrier, whose one arrival (arrive.expect_tx) announces the stage's bytes beforehand.
struct __align__(64) TensorMap {  // a CUtensorMap, encoded on the host (nvrtc.tensor_map_2d)
    u64 words[16];
};

__device__ __forceinline__ void barrier_expect(u32 address, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(address), "r"(bytes) : "memory");
}

// `bytes` (a multiple of 16, both ends 16-aligned) global -> shared
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 barrier) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(barrier) : "memory");
}

// the box of a 2-D tensor map at (c0 innermost, c1) -> shared, in the map's swizzle; elements out of the tensor
// land as zeros (and count as bytes)
__device__ __forceinline__ void tensor_copy(u32 dst, const TensorMap* map, int c0, int c1, u32 barrier) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                 "[%4];" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(barrier) : "memory");
}

// a shared-memory matrix descriptor: start address, leading (k) and stride (row) byte offsets, no swizzle
__device__ __forceinline__ u64 matrix_descriptor(u32 address) {
    return (u64)((address & 0x3FFFF) >> 4) | ((u64)(CORE_LBO >> 4) << 16) | ((u64)(CORE_SBO >> 4) << 32);
}

// x's descriptor: the 128-byte swizzle (layout type 1 at bit 62), 1024 bytes between 8-row atoms (SBO), the
// leading offset unused (1); a k16 step moves the start 32 bytes into the row, the atom staying 1024-aligned
__device__ __forceinline__ u64 swizzled_descriptor(u32 address) {
    return (u64)((address & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// wgmma_tile(d, a, b, accumulate): d (64 channels x BT tokens, fp32, the thread's BT / 2 values) = A (64 x 16,
// descriptor a) B (16 x BT, descriptor b) (+ d if accumulate); its text, one asm statement with BT / 2 operands,
// comes with the defines

// RS: nibbles (2t, 2t + 1) of word q (byte t: k 2t, 2t + 1 of the word's 8) as halves in k order, dequantized:
// PRMT puts byte t of q in the low half and byte t of q >> 4 in the high one, LOP3 keeps each half's low nibble over
// MAGIC (1024 in fp16, 128 in bf16: c exact), then (v - MAGIC) s + z, rounded once as the other kernels round
#if BF16
#define MAGIC2 0x43004300u
#else
#define MAGIC2 0x64006400u
#endif
__device__ __forceinline__ u32 natural_pair(u32 q, u32 select, u32 s2, u32 z2) {
    const u32 v = prmt(q, q >> 4, select);
    return dequant(and_or<0x000F000Fu>(v, MAGIC2), MAGIC2, s2, z2);
}

// the accumulators as the compiler must see them: written by the asynchronous wgmma, read only after its wait
__device__ __forceinline__ void fence_operands(float* d) {
#pragma unroll
    for (int i = 0; i < BT / 2; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// word q (nibbles c0..c7: k 8r .. 8r + 7 of one channel) dequantized, (v - offset) C s + z, into 8 halves in k order
__device__ __forceinline__ U4 dequant_word(u32 q, u32 cs2, u32 z2, u32 one, u32 sixteen, u32 offset_a) {
    const u32 q8 = q >> 8;
    const u32 p04 = dequant(unit_pair<0>(q, q8, one, sixteen), offset_a, cs2, z2);
    const u32 p15 = dequant(unit_pair<1>(q, q8, one, sixteen), one, cs2, z2);
    const u32 p26 = dequant(unit_pair<2>(q, q8, one, sixteen), offset_a, cs2, z2);
    const u32 p37 = dequant(unit_pair<3>(q, q8, one, sixteen), one, cs2, z2);
    U4 r;
    r.x = prmt(p04, p15, 0x5410);  // c0, c1
    r.y = prmt(p26, p37, 0x5410);  // c2, c3
    r.z = prmt(p04, p15, 0x7632);  // c4, c5
    r.w = prmt(p26, p37, 0x7632);  // c6, c7
    return r;
}

// the bytes a stage's copies bring: x's box (BT rows, those past M as zeros), the words, the scales and the zeros
#define STAGE_TX (BT * BK * 2 + 8 * BN * 4 + 2 * SC_BYTES)

// a stage's weights: the 8 rows of BN words of k tile kt, and its SROWS rows of scales and of zeros (the group
// rows of k 32 r), one bulk copy a row
__device__ __forceinline__ void copy_weights(u32 stage, u32 barrier, const u32* qw, const u16* scales,
                                             const u16* zeros, int N, int n0, int kt) {
#pragma unroll
    for (int r = 0; r < 8; ++r)
        bulk_copy(stage + RAW_OFFSET + r * BN * 4, qw + (u64)(kt * 8 + r) * N + n0, BN * 4, barrier);
#pragma unroll
    for (int r = 0; r < SROWS; ++r) {
        const u64 row = (u64)((kt * BK + r * 32) / GROUP) * N + n0;
        bulk_copy(stage + SC_OFFSET + r * BN * 2, scales + row, BN * 2, barrier);
        bulk_copy(stage + SC_OFFSET + SC_BYTES + r * BN * 2, zeros + row, BN * 2, barrier);
    }
}

// the dequantized A tile of a stage from its raw words: thread p takes channels p + 128 e, all 8 word rows
__device__ __forceinline__ void dequant_stage(u32 stage, u32 scale_c2, u32 one, u32 sixteen, u32 offset_a) {
    const int p = threadIdx.x;
#pragma unroll
    for (int e = 0; e < SLICES; ++e) {
        const int n = p + 128 * e;
        u32 cs2 = 0, z2 = 0;
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            if (r == 0 || (SROWS == 2 && r == 4)) {  // the group row of k 8r (two in a stage at group 32)
                const u32 at = stage + SC_OFFSET + (r / 4) % SROWS * BN * 2 + n * 2;
                const u32 s = lds16(at), z = lds16(at + SC_BYTES);
                cs2 = hmul2(s | ((u32)s << 16), scale_c2);  // u32: a u16 shifted as int would overflow
                z2 = z | ((u32)z << 16);
            }
            const u32 q = lds32(stage + RAW_OFFSET + r * BN * 4 + n * 4);
            sts128(stage + A_OFFSET + core_offset(n, r), dequant_word(q, cs2, z2, one, sixteen, offset_a));
        }
    }
}

// Stream-K: the CTAs split the tile-major sequence of (output tile, k tile) iterations evenly, CTA c taking
// [c I / G, (c + 1) I / G) of I = tiles x k tiles; tile t = token tile t % tiles_m, channel block t / tiles_m. A tile
// one CTA covers whole is written straight from the accumulators. The CTAs that share a tile each store their fp32
// partial, in register order, to a slot of their own and bump the tile's counter; the last to bump adds the
// others' partials to its accumulators, writes the tile and resets the counter (no atomics on the data, nothing to
// clean, no CTA waits for another). A CTA shares at most two tiles, its first segment's and its last's: slots
// 2c and 2c + 1, of BT x BN floats each.
struct Work {
    int tile, kt, m0, M, n0;  // output tile, k tile, its first token row and rows, its first channel
};

__device__ __forceinline__ Work work_of(int tile, int kt, int tiles_m, int rows) {
    Work w;
    w.tile = tile;
    w.kt = kt;
    w.m0 = (tile % tiles_m) * BT;
    w.M = rows - w.m0 < BT ? rows - w.m0 : BT;
    w.n0 = (tile / tiles_m) * BN;
    return w;
}

__device__ __forceinline__ Work work_at(long long it, int KT, int tiles_m, int rows) {  // one 64-bit division
    return work_of((int)(it / KT), (int)(it % KT), tiles_m, rows);
}

// the iteration after w: the next k tile, or the next tile's first (the producer walks its range this way, with no
// division in its loop but at a tile's change)
__device__ __forceinline__ Work next_work(const Work& w, int KT, int tiles_m, int rows) {
    return w.kt + 1 < KT ? work_of(w.tile, w.kt + 1, tiles_m, rows) : work_of(w.tile + 1, 0, tiles_m, rows);
}

__device__ __forceinline__ int owner(long long it, long long total) {  // the CTA whose range holds iteration it
    return (int)(((it + 1) * gridDim.x - 1) / total);
}

// CTA c's slot for its partial of tile t: 2c where t is the tile of its first iteration, else 2c + 1
__device__ __forceinline__ int partial_slot(int c, int tile, long long total, int KT) {
    return 2 * c + (int)(c * total / gridDim.x / KT != tile);
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 2, 256;" ::: "memory"); }

// a consumer thread's accumulators in register order: float f of thread p at ((f / 4) 256 + p) 4 + f % 4, so that
// each 16-byte store or load of a warp is 512 contiguous bytes
__device__ __forceinline__ void store_partial(float* slot, float (*d)[BT / 2], int p) {
#pragma unroll
    for (int e = 0; e < SLICES; ++e)
#pragma unroll
        for (int j = 0; j < BT / 2; j += 4) {
            float* at = slot + (u64)(((e * (BT / 2) + j) / 4) * 256 + p) * 4;
            asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(at), "f"(d[e][j]), "f"(d[e][j + 1]),
                         "f"(d[e][j + 2]), "f"(d[e][j + 3]) : "memory");
        }
}

__device__ __forceinline__ void add_partial(float (*d)[BT / 2], const float* slot, int p) {
#pragma unroll
    for (int e = 0; e < SLICES; ++e)
#pragma unroll
        for (int j = 0; j < BT / 2; j += 4) {
            const float* at = slot + (u64)(((e * (BT / 2) + j) / 4) * 256 + p) * 4;
            float a, b, c, f;  // from the L2: another SM wrote it
            asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(a), "=f"(b), "=f"(c), "=f"(f) : "l"(at)
                         : "memory");
            d[e][j] += a;
            d[e][j + 1] += b;
            d[e][j + 2] += c;
            d[e][j + 3] += f;
        }
}

// x itself is unread (the copies read it through x_map): it stays for launch_w4a16's signature, shared by three kernels
extern "C" __global__ void __launch_bounds__(THREADS, CTAS_PER_SM)
w4a16_wgmma(const u16* __restrict__ x, const u32* __restrict__ qw, const u16* __restrict__ scales,
            const u16* __restrict__ zeros, const u16* __restrict__ bias, u16* __restrict__ out,
            float* __restrict__ ws, int* __restrict__ counters, int rows, int N, int K,
            const __grid_constant__ TensorMap x_map, int has_bias) {
    extern __shared__ __align__(1024) char smem[];
    // mbarriers: full[s] (the copying thread's arrival and the stage's bytes: its copies have landed), empty[s] (one
    // arrival per consumer warpgroup: its reads of the stage are over), ready[s] (SS: one producer arrival, A is
    // dequantized; RS: full[s] itself)
    __shared__ __align__(8) u64 barriers[3 * STAGES];
    __shared__ int last_contributor;  // of a shared tile: whether this CTA's bump of its counter was the last
    const int KT = K / BK, tiles_m = (rows + BT - 1) / BT;
    const long long total = (long long)tiles_m * (N / BN) * KT;
    const long long it0 = blockIdx.x * total / gridDim.x;
    const int count = (int)((blockIdx.x + 1) * total / gridDim.x - it0);
    const u32 base = smem_address(smem), full = smem_address(barriers), empty = full + 8 * STAGES;
    const u32 dequantized = empty + 8 * STAGES, ready = RS ? full : dequantized;
    if (threadIdx.x == 0) {
        if (base & 1023) __trap();  // the swizzle atoms of x must be 1024-aligned (the extern's __align__)
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(full + 8 * s, 1);
            barrier_init(empty + 8 * s, 2);
            if (!RS) barrier_init(dequantized + 8 * s, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int warpgroup = threadIdx.x / 128;

    if (warpgroup == 0) {  // the producer: thread 0 copies PREFETCH iterations ahead; SS: all dequantize
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGISTERS));
        const bool copier = threadIdx.x == 0;
#if RS
        if (!copier) return;
#endif
        const Work start = work_at(it0, KT, tiles_m, rows);
        Work w = start;  // the iteration whose copies go out next
        if (copier) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(&x_map) : "memory");
            for (int j = 0; j < PREFETCH && j < count; ++j, w = next_work(w, KT, tiles_m, rows)) {
                barrier_expect(full + 8 * j, STAGE_TX);
                copy_weights(base + j * STAGE_BYTES, full + 8 * j, qw, scales, zeros, N, w.n0, w.kt);
            }
        }
#if PDL
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
        if (copier) {
            Work v = start;
            for (int j = 0; j < PREFETCH && j < count; ++j, v = next_work(v, KT, tiles_m, rows))
                tensor_copy(base + j * STAGE_BYTES + X_OFFSET, &x_map, v.kt * BK, v.m0, full + 8 * j);
        }
#if !RS
        const u32 one = opaque(ONE2), sixteen = opaque(0x4C004C00u), offset_a = WORD_DECODE ? sixteen : one;
        const u32 scale_c2 = SCALE_C2;  // C s: finite while |s| < 1024
#endif
        for (int i = 0; i < count; ++i) {
            const int j = i + PREFETCH;
            if (copier && j < count) {
                const int sj = j % STAGES;
                if (j >= STAGES) barrier_wait(empty + 8 * sj, ((j / STAGES) & 1) ^ 1);  // iteration j - STAGES read
                const u32 stage = base + sj * STAGE_BYTES;
                barrier_expect(full + 8 * sj, STAGE_TX);
                copy_weights(stage, full + 8 * sj, qw, scales, zeros, N, w.n0, w.kt);
                tensor_copy(stage + X_OFFSET, &x_map, w.kt * BK, w.m0, full + 8 * sj);
                w = next_work(w, KT, tiles_m, rows);
            }
#if !RS
            const int s = i % STAGES;
            barrier_wait(full + 8 * s, (i / STAGES) & 1);  // iteration i's copies have landed
            dequant_stage(base + s * STAGE_BYTES, scale_c2, one, sixteen, offset_a);
            fence_async_proxy();  // this thread's A rows, before the consumers' wgmma reads
            producers_sync();
            if (copier) barrier_arrive(ready + 8 * s);
#endif
        }
        return;
    }

    // a consumer: channels (warpgroup - 1) * 64 SLICES .. of the tile, all BT tokens
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGISTERS));
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
    const int slice0 = (warpgroup - 1) * SLICES;
    const int lane = threadIdx.x & 31, w4 = (threadIdx.x >> 5) & 3, g = lane >> 2, t = lane & 3;
#if RS
    const u32 pair_select = t | (t << 4) | ((4 + t) << 8) | ((4 + t) << 12);  // natural_pair's PRMT: byte t, twice
#endif
    float d[SLICES][BT / 2];
#if RS
    // A fragments, one register set a k16 step in flight: RS_DEPTH steps' groups may still read theirs when the next
    // set is written (a step's set is k16 step kk's, kk % SETS, the same in every k tile)
#define SETS (RS_DEPTH + 1)
    u32 a[SETS][SLICES][4];
#endif
    // the accumulators are touched by wgmma alone inside a segment (its first MMA overwrites them: scale-d 0), so
    // that ptxas keeps one group in flight; the epilogue reads them after the segment's last wait
    bool previous_released = true;  // iteration i - 1's stage handed back to the producer (none before i = 0)
    for (int i = 0; i < count;) {
        const Work w = work_at(it0 + i, KT, tiles_m, rows);
        const int first_kt = w.kt, length = count - i < KT - w.kt ? count - i : KT - w.kt;
        for (int step = 0; step < length; ++step, ++i) {
            const int s = i % STAGES;
            const u32 stage = base + s * STAGE_BYTES;
            barrier_wait(ready + 8 * s, (i / STAGES) & 1);
#if RS
            // A from registers: every k16 step's fragments decoded by this warp from the stage's raw words, into the
            // set of its step; its group is one wgmma a slice, and RS_DEPTH of them stay in flight
            u32 cs2[SLICES][2], z2[SLICES][2];
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
#pragma unroll
                for (int e = 0; e < SLICES; ++e) {
                    const int n = (slice0 + e) * 64 + 16 * w4 + g;  // fragment rows g and g + 8
                    if (kk == 0 || (SROWS == 2 && kk == 2)) {  // the group row of k 16 kk
                        const u32 at = stage + SC_OFFSET + (kk / 2) % SROWS * BN * 2 + n * 2;
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const u32 sc = lds16(at + 16 * h), z = lds16(at + SC_BYTES + 16 * h);
                            cs2[e][h] = sc | ((u32)sc << 16);
                            z2[e][h] = z | ((u32)z << 16);
                        }
                    }
                    // a0: row g, k 2t, 2t + 1 (word row 2 kk); a1: row g + 8; a2, a3: k 2t + 8, 2t + 9 (row 2 kk + 1)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const u32 q = lds32(stage + RAW_OFFSET + (2 * kk + (r >> 1)) * BN * 4 + (n + 8 * (r & 1)) * 4);
                        a[kk % SETS][e][r] = natural_pair(q, pair_select, cs2[e][r & 1], z2[e][r & 1]);
                    }
                }
#pragma unroll
                for (int e = 0; e < SLICES; ++e) fence_operands(d[e]);
                wgmma_fence();
#pragma unroll
                for (int e = 0; e < SLICES; ++e)
                    wgmma_tile_rs(d[e], a[kk % SETS][e], swizzled_descriptor(stage + X_OFFSET + kk * 32),
                                  step > 0 || kk > 0);
                wgmma_commit();
                // the step RS_DEPTH back is done: its set is free, and from kk = RS_DEPTH - 1 on every step of the
                // previous k tile, so its stage goes back
                wgmma_wait<RS_DEPTH>();
#pragma unroll
                for (int e = 0; e < SLICES; ++e) fence_operands(d[e]);
                if (kk == RS_DEPTH - 1) {
                    if (!previous_released && threadIdx.x % 128 == 0)
                        barrier_arrive(empty + 8 * ((i - 1) % STAGES));
                    previous_released = false;
                }
            }
#else
#pragma unroll
            for (int e = 0; e < SLICES; ++e) fence_operands(d[e]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk)  // k16 steps: two core matrices along k each
#pragma unroll
                for (int e = 0; e < SLICES; ++e)
                    wgmma_tile(d[e],
                               matrix_descriptor(stage + A_OFFSET + (slice0 + e) * 8 * CORE_SBO + kk * 2 * CORE_LBO),
                               swizzled_descriptor(stage + X_OFFSET + kk * 32), step > 0 || kk > 0);
            wgmma_commit();
            wgmma_wait<1>();  // iteration i - 1's group is done: its stage goes back to the producer, if not yet
#pragma unroll
            for (int e = 0; e < SLICES; ++e) fence_operands(d[e]);
            if (!previous_released && threadIdx.x % 128 == 0) barrier_arrive(empty + 8 * ((i - 1) % STAGES));
            previous_released = false;
#endif
        }
        wgmma_wait<0>();  // the segment's last stage goes back now, before the epilogue
        if (threadIdx.x % 128 == 0) barrier_arrive(empty + 8 * ((i - 1) % STAGES));
        previous_released = true;
#pragma unroll
        for (int e = 0; e < SLICES; ++e) fence_operands(d[e]);

        // the segment of tile w.tile ends here. d[e][4v + q] of warp w4, lane (g, t): channel 16 w4 + g of slice
        // slice0 + e (+ 8 for q >= 2), token 8v + 2t (+ 1 for odd q)
        const int last_kt = first_kt + length - 1;
        if (first_kt != 0 || last_kt != KT - 1) {  // a shared tile
            const int first_owner = owner((long long)w.tile * KT, total);
            const int last_owner = owner((long long)(w.tile + 1) * KT - 1, total);
            const int p = threadIdx.x - 128;
            store_partial(ws + (u64)partial_slot(blockIdx.x, w.tile, total, KT) * BT * BN, d, p);
            __threadfence();
            consumers_sync();
            if (p == 0) last_contributor = atomicAdd(counters + w.tile, 1) == last_owner - first_owner;
            consumers_sync();
            if (!last_contributor) continue;
            __threadfence();
            for (int c = first_owner; c <= last_owner; ++c)
                if (c != (int)blockIdx.x) add_partial(d, ws + (u64)partial_slot(c, w.tile, total, KT) * BT * BN, p);
            if (p == 0) counters[w.tile] = 0;
        }
        u16* tile_out = out + (u64)w.m0 * N + w.n0;
#pragma unroll
        for (int e = 0; e < SLICES; ++e) {
            const int ch = (slice0 + e) * 64 + 16 * w4 + g;  // within the tile
            float b_lo = 0.f, b_hi = 0.f;
            if (has_bias) {
                b_lo = to_float(bias[w.n0 + ch], 0);
                b_hi = to_float(bias[w.n0 + ch + 8], 0);
            }
#pragma unroll
            for (int v = 0; v < BT / 8; ++v) {
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int m = 8 * v + 2 * t + (q & 1), c = ch + (q >> 1) * 8;
                    if (m < w.M) tile_out[(u64)m * N + c] = from_float(d[e][4 * v + q] + (q >> 1 ? b_hi : b_lo));
                }
            }
        }
    }
}
