"""A lane-level emulation of the CUDA kernel in `w4a16_wgmma.SOURCE`, for CI machines without a GPU.

It follows the source, vectorized over the producer's 128 threads and each consumer warpgroup's: the bulk and TMA
copies (the bytes where they land: x's box in the 128-byte swizzle, zeros past M) into a byte-addressed shared memory
(`SharedMemory`, which counts bank conflicts), the stage each tile takes and the order of refills, decodes and reads
the mbarriers allow, the decode and dequant of every word with the GEMV emulation's bit operations and its 16-byte
store at the core-matrix address, the matrix descriptors as the source builds them read back through wgmma's canonical
K-major layouts (A without swizzle: core matrix (row / 8, k / 8) at start + (row / 8) SBO + (k / 8) LBO, rows of 16
bytes; x in the 128-byte swizzle: rows of 128 bytes, SBO between 8-row atoms, address bits 4-6 XORed with bits 7-9),
the accumulator registers of wgmma's D layout (each warp 16 rows as m16n8 C fragments along n), the stores of a whole
tile, and the partial slots and counters of shared tiles (the CTAs run in a shuffled order, so that any contributor
may be the last). Each stage's copies land exactly the bytes the source's STAGE_TX announces. What the hardware does
with the same text is the GPU probe's job (`benchmarks/w4a16_mma_probe.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from lmd.turbomind.kernels.w4a16_wgmma import (
    BLOCK_K,
    SOURCE,
    WgmmaConfig,
    grid_size,
    iterations,
    shared_bytes,
    stage_layout,
)
from tests.turbomind.kernels.mma_gemv_lanes import _bits, _halves, as_words, decode_constants, dequant, prmt, unit_pair
from tests.turbomind.kernels.shared_memory_model import SharedMemory

CORE_LBO, CORE_SBO = 128, 1024
P = torch.arange(128)  # a warpgroup's threads


def core_offset(row: torch.Tensor, k8: torch.Tensor | int) -> torch.Tensor:
    return (row >> 3) * CORE_SBO + k8 * CORE_LBO + (row & 7) * 16


def x_offset(m: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Where a TMA box in the 128-byte swizzle puts token m's chunk c: its row of 128 bytes, at c ^ (m % 8)."""
    return m * 128 + ((c ^ (m & 7)) << 4)


def prmt_lanes(a: torch.Tensor, b: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """prmt.b32 with a selector of each lane's own (`mma_gemv_lanes.prmt` takes one for all)."""
    pool = torch.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
    out = torch.zeros_like(a)
    for k in range(4):
        out |= pool.gather(0, ((select >> (4 * k)) & 7)[None])[0] << (8 * k)
    return out


def descriptor(address: int) -> int:
    """matrix_descriptor() of the source: start >> 4, LBO >> 4 at bit 16, SBO >> 4 at bit 32, no swizzle."""
    return ((address & 0x3FFFF) >> 4) | ((CORE_LBO >> 4) << 16) | ((CORE_SBO >> 4) << 32)


def swizzled_descriptor(address: int) -> int:
    """swizzled_descriptor() of the source: start >> 4, LBO 1 (unused), SBO 1024 >> 4, layout type 1 (128-byte
    swizzle) at bit 62."""
    return ((address & 0x3FFFF) >> 4) | (1 << 16) | ((1024 >> 4) << 32) | (1 << 62)


def read_operand(smem: SharedMemory, desc: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """A K-major operand of `rows` x 16 as wgmma reads it through a descriptor, without swizzle (layout type 0) or in
    the 128-byte swizzle (type 1: rows of 128 bytes from the start, SBO between 8-row atoms, then address bits 4-6
    XORed with bits 7-9, which puts an atom's pattern on 1024-byte boundaries): [rows, 16] fp32."""
    start, lbo, sbo = (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4
    layout = desc >> 62
    assert layout in (0, 1) and ((desc >> 49) & 7) == 0, "a 32- or 64-byte swizzle, or a base offset"
    row = torch.arange(rows)[:, None]
    k = torch.arange(16)[None, :]
    if layout == 0:
        address = start + (row // 8) * sbo + (k // 8) * lbo + (row % 8) * 16 + (k % 8) * 2
    else:
        linear = start + (row // 8) * sbo + (row % 8) * 128 + k * 2
        address = linear ^ (((linear >> 7) & 7) << 4)
    halves = (smem.words[address // 4] >> (8 * (address % 4))) & 0xFFFF
    return halves.to(torch.int16).view(dtype).float()


def run(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
        bias: torch.Tensor | None, cfg: WgmmaConfig, resident: int = 132) -> tuple[torch.Tensor, int]:
    """(what the kernel writes for x [M, K] fp16/bf16, as `wgmma_gemm` launches it on a GPU that holds `resident`
    CTAs at once; the bank conflicts met). Checks on the way that every output is written once and that the tiles'
    counters are all-zero again at the end."""
    rows, k = x.shape
    n = qweight.shape[1]
    tiles, total = iterations(cfg, rows, n, k)
    ctas = grid_size(cfg, rows, n, k, resident)
    # two partial slots a CTA, of block_t x block_n floats in register order; a counter a tile
    state = Outputs(torch.full((rows, n), float("nan"), dtype=x.dtype), torch.zeros(rows, n, dtype=torch.int64),
                    torch.full((2 * ctas, cfg.block_t * cfg.block_n), float("nan")),
                    torch.zeros(tiles, dtype=torch.int64))
    conflicts = 0
    for c in torch.randperm(ctas, generator=torch.Generator().manual_seed(total)).tolist():  # any order the GPU runs
        it0 = c * total // ctas
        conflicts += _cta(x, qweight, scales, zeros, bias, cfg, c, it0, (c + 1) * total // ctas - it0, ctas, total,
                          state)
    assert bool((state.writes == 1).all()), "an output element written more than once or never"
    assert not bool(state.counters.any()), "a shared tile's counter is not reset"
    return state.out, conflicts


@dataclass
class Outputs:
    out: torch.Tensor
    writes: torch.Tensor  # times each output element was written
    ws: torch.Tensor  # partial slots, two a CTA: block_t x block_n fp32 each, in register order
    counters: torch.Tensor  # one a tile


def _cta(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         bias: torch.Tensor | None, cfg: WgmmaConfig, cta: int, it0: int, count: int, ctas: int, total: int,
         state: Outputs) -> int:
    dtype = x.dtype
    rows, k = x.shape
    group = k // scales.shape[0]
    kt_count, tiles_m = k // BLOCK_K, -(-rows // cfg.block_t)
    bn, bt, stages = cfg.block_n, cfg.block_t, cfg.stages
    slices, prefetch = bn // 128, stages - 1 if cfg.rs else stages - 2  # PREFETCH
    scale_rows = BLOCK_K // group if group < BLOCK_K else 1
    layout = stage_layout(cfg, group)
    x_at, a_offset, raw_offset = layout["X_OFFSET"], layout["A_OFFSET"], layout["RAW_OFFSET"]
    sc_offset, sc_bytes, stage = layout["SC_OFFSET"], layout["SC_BYTES"], layout["STAGE_BYTES"]
    assert stage % 1024 == 0 and x_at % 1024 == 0  # x's swizzle atoms on 1024-byte boundaries, in every stage
    smem = SharedMemory(shared_bytes(cfg, group))
    word = cfg.word_decode and dtype == torch.float16
    one2, offset_a, scale_c = decode_constants(dtype, word)
    q_words, x_words, s_words, z_words = as_words(x, qweight, scales, zeros)
    quads = torch.arange(4)

    def work_at(it: int) -> tuple[int, int, int, int, int]:  # (tile, k tile, first row, rows, first channel)
        tile, kt = it // kt_count, it % kt_count
        m0 = (tile % tiles_m) * bt
        return tile, kt, m0, min(bt, rows - m0), (tile // tiles_m) * bn

    def owner(it: int) -> int:
        return ((it + 1) * ctas - 1) // total

    def partial_slot(c: int, t: int) -> int:  # 2c where t is the tile of c's first iteration, else 2c + 1
        return 2 * c + int(c * total // ctas // kt_count != t)

    def slot_order(regs: torch.Tensor) -> torch.Tensor:  # float f of thread p at ((f / 4) 256 + p) 4 + f % 4
        flat = regs.reshape(256, -1)
        return flat.reshape(256, -1, 4).permute(1, 0, 2).reshape(-1)

    def from_slot_order(slot: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return slot.reshape(-1, 256, 4).permute(1, 0, 2).reshape(shape)

    tx_text = re.search(r"#define STAGE_TX \((.*)\)", SOURCE)
    assert tx_text, "w4a16_wgmma.cu no longer defines STAGE_TX"
    stage_tx = eval(tx_text.group(1), {"BT": bt, "BK": BLOCK_K, "BN": bn, "SC_BYTES": sc_bytes})  # noqa: S307

    def copy_weights(base: int, n0: int, kt: int) -> int:
        """copy_weights(): one bulk copy a row of words, scales and zeros (16-byte pieces here, no bank traffic);
        returns the bytes landed."""
        landed = 0
        for r in range(8):
            chunks = torch.arange(bn // 4)
            words = q_words[kt * 8 + r, (n0 + 4 * chunks)[:, None] + quads]
            smem.copy16(base + raw_offset + r * bn * 4 + chunks * 16, words, torch.ones_like(chunks, dtype=bool))
            landed += 16 * len(chunks)
        for r in range(scale_rows):
            row = (kt * BLOCK_K + r * 32) // group
            chunks = torch.arange(bn // 8)
            for which, words in enumerate((s_words, z_words)):
                landed += 16 * len(chunks)
                smem.copy16(base + sc_offset + which * sc_bytes + r * bn * 2 + chunks * 16,
                            words[row, ((n0 + 8 * chunks) // 2)[:, None] + quads], torch.ones_like(chunks, dtype=bool))
        return landed

    def copy_x(base: int, m0: int, m_rows: int, kt: int) -> int:
        """tensor_copy() of x_map's box at (k 64 kt, row m0): bt rows of 64 k in the 128-byte swizzle, rows past M
        as zeros; returns the bytes landed (the whole box: rows past M count)."""
        i = torch.arange(bt * 8)
        m, c = i >> 3, i & 7
        valid = m < m_rows
        src = x_words[m0 + torch.where(valid, m, 0)[:, None], ((kt * BLOCK_K + c * 8) // 2)[:, None] + quads]
        smem.copy16(base + x_at + x_offset(m, c), src, valid)
        return 16 * len(i)

    def dequant_stage(base: int) -> None:
        for e in range(slices):
            nn = P + 128 * e
            for r in range(8):
                if r == 0 or (scale_rows == 2 and r == 4):
                    at = base + sc_offset + (r // 4) % scale_rows * bn * 2 + nn * 2
                    s, zr = smem.load16(at), smem.load16(at + sc_bytes)
                    cs2 = _bits((_halves(s | (s << 16), dtype) * scale_c).to(dtype))[:, 0]  # hmul2 by C, exact
                    z2 = zr | (zr << 16)
                q = smem.load(base + raw_offset + r * bn * 4 + nn * 4, 1)[:, 0]
                q8 = q >> 8
                pairs = [dequant(unit_pair(i, q, q8, dtype, word), offset_a if i % 2 == 0 else one2, cs2, z2, dtype)
                         for i in range(4)]  # nibbles (0, 4), (1, 5), (2, 6), (3, 7)
                halves = torch.stack([prmt(pairs[0], pairs[1], 0x5410), prmt(pairs[2], pairs[3], 0x5410),
                                      prmt(pairs[0], pairs[1], 0x7632), prmt(pairs[2], pairs[3], 0x7632)], dim=1)
                smem.store(base + a_offset + core_offset(nn, r), halves)

    magic = 0x43004300 if dtype == torch.bfloat16 else 0x64006400  # MAGIC2: 128 / 1024, where c is exact
    lane_ = P % 32
    g_, t_ = lane_ >> 2, lane_ & 3
    select = t_ | (t_ << 4) | ((4 + t_) << 8) | ((4 + t_) << 12)  # pair_select

    def rs_fragments(base: int, slice_: int, kk: int) -> torch.Tensor:
        """RS: a consumer warpgroup's A fragments for one slice and k16 step, decoded from the stage's raw words lane
        by lane (natural_pair), put together as the [64, 16] A they stand for (each warp 16 rows, mma.sync's
        m16n8k16 A layout)."""
        n = slice_ * 64 + 16 * (P // 32) + g_
        at = base + sc_offset + (kk // 2) % scale_rows * bn * 2 + n * 2
        s2 = [smem.load16(at + 16 * h) for h in range(2)]
        z2 = [smem.load16(at + sc_bytes + 16 * h) for h in range(2)]
        a = torch.zeros(64, 16)
        for r in range(4):
            q = smem.load(base + raw_offset + (2 * kk + (r >> 1)) * bn * 4 + (n + 8 * (r & 1)) * 4, 1)[:, 0]
            v = prmt_lanes(q, q >> 4, select)
            u = (v & 0x000F000F) | magic
            h = r & 1
            pair = dequant(u, magic, s2[h] | (s2[h] << 16), z2[h] | (z2[h] << 16), dtype)
            halves = _halves(pair, dtype)  # [128, 2]
            rows = 16 * (P // 32) + g_ + 8 * (r & 1)
            cols = 2 * t_ + 8 * (r >> 1)
            a[rows, cols] = halves[:, 0]
            a[rows, cols + 1] = halves[:, 1]
        return a

    landed = []
    for j in range(min(prefetch, count)):  # the prologue: weights, then (after the PDL wait) x
        _, kt, _, _, n0 = work_at(it0 + j)
        landed.append(copy_weights(j * stage, n0, kt))
    for j in range(min(prefetch, count)):
        _, kt, m0, m_rows, _ = work_at(it0 + j)
        assert landed[j] + copy_x(j * stage, m0, m_rows, kt) == stage_tx
    d = torch.full((2, slices, 64, bt), float("nan"))  # consumer warpgroup, slice: D [channels, tokens]; never zeroed
    lane = P % 32
    w4, g, t = P // 32, lane >> 2, lane & 3
    i = 0
    while i < count:  # the consumers' segments: a tile's k tiles in this CTA's range
        tile, first_kt, m0, m_rows, n0 = work_at(it0 + i)
        length = min(count - i, kt_count - first_kt)
        for step in range(length):
            j = i + prefetch
            if j < count:  # the producer, ahead: the stage of iteration j - stages, consumed already
                _, kt, jm0, jm_rows, jn0 = work_at(it0 + j)
                landed_j = copy_weights((j % stages) * stage, jn0, kt)
                assert landed_j + copy_x((j % stages) * stage, jm0, jm_rows, kt) == stage_tx
            base = (i % stages) * stage
            if not cfg.rs:
                dequant_stage(base)
            for wg in range(2):  # after full[i % stages]
                for kk in range(BLOCK_K // 16):
                    b = read_operand(smem, swizzled_descriptor(base + x_at + kk * 32), bt, dtype)
                    for e in range(slices):
                        if cfg.rs:
                            a_tile = rs_fragments(base, wg * slices + e, kk)
                        else:
                            a_desc = descriptor(base + a_offset + (wg * slices + e) * 8 * CORE_SBO + kk * 2 * CORE_LBO)
                            a_tile = read_operand(smem, a_desc, 64, dtype)
                        product = a_tile @ b.T
                        d[wg, e] = d[wg, e] + product if step > 0 or kk > 0 else product  # scale-d
            i += 1
        last_kt = first_kt + length - 1
        # the segment's end: the registers d[e][4v + q] of warp w4, lane (g, t) = D[16 w4 + g + 8 (q >> 1), 8v + 2t
        # + (q & 1)]; a shared tile's partial goes to this CTA's slot, and the last contributor adds the others'
        regs = torch.zeros(2, 128, slices, bt // 2)  # consumer warpgroup, thread, the thread's d[e][j]
        for wg in range(2):
            for e in range(slices):
                for v in range(bt // 8):
                    for q in range(4):
                        regs[wg, :, e, 4 * v + q] = d[wg, e, 16 * w4 + g + 8 * (q >> 1), 8 * v + 2 * t + (q & 1)]
        if first_kt != 0 or last_kt != kt_count - 1:
            first_owner, last_owner = owner(tile * kt_count), owner((tile + 1) * kt_count - 1)
            state.ws[partial_slot(cta, tile)] = slot_order(regs)
            state.counters[tile] += 1
            if int(state.counters[tile]) != last_owner - first_owner + 1:
                continue
            for c in range(first_owner, last_owner + 1):
                if c != cta:
                    regs = regs + from_slot_order(state.ws[partial_slot(c, tile)], regs.shape)
            state.counters[tile] = 0
        for wg in range(2):
            for e in range(slices):
                ch = n0 + (wg * slices + e) * 64 + 16 * w4 + g
                if bias is not None:
                    b_lo, b_hi = bias[ch].float(), bias[ch + 8].float()
                for v in range(bt // 8):
                    for q in range(4):
                        m, c = 8 * v + 2 * t + (q & 1), ch + (q >> 1) * 8
                        value = regs[wg, :, e, 4 * v + q]
                        if bias is not None:
                            value = value + (b_hi if q >> 1 else b_lo)
                        keep = m < m_rows
                        rows_, cols_ = m0 + m[keep], c[keep]
                        state.out[rows_, cols_] = value[keep].to(dtype)
                        state.writes[rows_, cols_] += 1
    return smem.conflicts
