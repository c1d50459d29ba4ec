"""A lane-level emulation of the CUDA kernel in `w4a16_mma_gemm.SOURCE`, for CI machines without a GPU.

It follows the source statement by statement, vectorized over the 32 lanes of a warp: the cp.async copies into a
byte-addressed shared memory at the swizzled addresses, the pipeline's order of refills and reads, the 16- and
8-byte shared loads (each checked for bank conflicts: a phase of 8 or 16 lanes must touch different banks unless
lanes share an address), the decode, dequant and `mma.sync` fragments of the GEMV's lane emulation
(`mma_gemv_lanes`), the stores of the D fragments (each output element written exactly once) and the split-K
workspace. What the CUDA text does on a GPU is the probe's job (`benchmarks/w4a16_mma_probe.py`).
"""

from __future__ import annotations

import torch

from lmd.turbomind.kernels.w4a16_mma_gemm import BLOCK_K, MmaGemmConfig, launch_shape, shared_bytes
from tests.turbomind.kernels.mma_gemv_lanes import (
    CHANNEL,
    G,
    T,
    _bits,
    _dup,
    _halves,
    as_words,
    decode_constants,
    dequant,
    mma,
    prmt,
    unit_pair,
)
from tests.turbomind.kernels.shared_memory_model import SharedMemory


def w_chunk(row: torch.Tensor, c: torch.Tensor) -> torch.Tensor:  # the source's swizzles
    return c ^ ((row & 3) << 1)


def x_chunk(row: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return c ^ ((row & 1) << 2)


def run(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
        bias: torch.Tensor | None, cfg: MmaGemmConfig) -> tuple[torch.Tensor, int]:
    """(what the kernel writes for x [M, K] fp16/bf16, as `mma_gemm` launches it; the bank conflicts met)."""
    rows, k = x.shape
    n = qweight.shape[1]
    group = k // scales.shape[0]
    (tiles_m, tiles_n, splits), per_split = launch_shape(cfg, rows, n, k)
    out = torch.full((rows, n), float("nan"), dtype=x.dtype)
    writes = torch.zeros(rows, n, dtype=torch.int64)
    conflicts = 0
    for tm in range(tiles_m):  # grid x: token tiles
        m0 = tm * cfg.block_m
        for tn in range(tiles_n):  # grid y: channel blocks
            ws = torch.zeros(cfg.block_m, cfg.block_n)
            for z in range(splits):  # grid z: K splits; the last one reads the workspace
                conflicts += _cta(x[m0:m0 + cfg.block_m], qweight, scales, zeros, bias, cfg, group, tn * cfg.block_n,
                                  z * per_split, min(per_split, k // BLOCK_K - z * per_split), splits > 1,
                                  out[m0:m0 + cfg.block_m], writes[m0:m0 + cfg.block_m], ws)
            if splits > 1:
                m_rows = min(cfg.block_m, rows - m0)
                cols = slice(tn * cfg.block_n, (tn + 1) * cfg.block_n)
                v = ws[:m_rows] + (bias[cols].float() if bias is not None else 0.0)
                out[m0:m0 + m_rows, cols] = v.to(x.dtype)
                writes[m0:m0 + m_rows, cols] += 1
    assert bool((writes == 1).all()), "an output element written more than once or never"
    return out, conflicts


def _cta(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         bias: torch.Tensor | None, cfg: MmaGemmConfig, group: int, n0: int, first: int, count: int, split: bool,
         out: torch.Tensor, writes: torch.Tensor, ws: torch.Tensor) -> int:
    dtype = x.dtype
    m_rows, k = x.shape
    n = qweight.shape[1]
    bn, bm, mb = cfg.block_n, cfg.block_m, cfg.warp_m // 8
    scale_rows = BLOCK_K // group if group < BLOCK_K else 1
    w_bytes, x_bytes, s_bytes = 8 * bn * 4, bm * BLOCK_K * 2, scale_rows * bn * 2
    stage_bytes = w_bytes + x_bytes + 2 * s_bytes
    assert cfg.stages * stage_bytes == shared_bytes(cfg, group)
    smem = SharedMemory(cfg.stages * stage_bytes)
    word = cfg.word_decode and dtype == torch.float16
    one2, offset_a, scale_c = decode_constants(dtype, word)
    q_words, x_words, s_words, z_words = as_words(x, qweight, scales, zeros)
    quads = torch.arange(4)

    # the Copier: a thread's chunk column and first rows, its rows advancing by constant steps
    threads = 32 * cfg.warps_n * cfg.warps_m
    tid = torch.arange(threads)
    w_step, x_step = threads // (bn // 4), threads // 8
    w_per, x_per = -(-8 // w_step), -(-bm // x_step)
    wc, w_row = tid % (bn // 4), tid // (bn // 4)
    w_dst = w_row * bn * 4 + w_chunk(w_row, wc) * 16
    xc, x_row = tid % 8, tid // 8
    x_src_row = torch.where(x_row < m_rows, x_row, 0)
    x_dst = w_bytes + x_row * BLOCK_K * 2 + x_chunk(x_row, xc) * 16
    s_chunks = 2 * scale_rows * (bn // 8)
    which, sc = tid // (scale_rows * (bn // 8)), tid % (bn // 8)
    s_row = torch.where(tid < s_chunks, (tid // (bn // 8)) % scale_rows, -1)
    s_dst = w_bytes + x_bytes + which * s_bytes + s_row.clamp(min=0) * bn * 2 + sc * 16

    def copy_weights(stage: int, kt: int) -> None:
        for u in range(w_per):
            flip = 0 if w_step % 4 == 0 or u % 2 == 0 else 64
            on = torch.ones_like(tid, dtype=torch.bool) if w_step * w_per == 8 else w_row + u * w_step < 8
            row = (kt * 8 + w_row + u * w_step)[on]
            smem.copy16(stage + ((w_dst[on] + u * w_step * bn * 4) ^ flip),
                        q_words[row[:, None], (n0 + 4 * wc[on])[:, None] + quads], torch.ones_like(row, dtype=bool))
        on = s_row >= 0
        group_row = (kt * BLOCK_K + s_row[on] * 32) // group
        cols = ((n0 + 8 * sc[on]) // 2)[:, None] + quads
        src = torch.where(which[on][:, None] == 1, z_words[group_row[:, None], cols], s_words[group_row[:, None], cols])
        smem.copy16(stage + s_dst[on], src, torch.ones_like(group_row, dtype=bool))

    def copy_x(stage: int, kt: int) -> None:
        for u in range(x_per):
            m = x_row + u * x_step
            on = torch.ones_like(tid, dtype=torch.bool) if x_step * x_per == bm else m < bm
            valid = (m < m_rows)[on]
            row = torch.where(valid, x_src_row[on] + u * x_step, x_src_row[on])
            src = x_words[row[:, None], ((kt * BLOCK_K + 8 * xc[on]) // 2)[:, None] + quads]
            smem.copy16(stage + x_dst[on] + u * x_step * BLOCK_K * 2, src, valid)

    for s in range(cfg.stages - 1):  # the prologue: weights, then (after the PDL wait) x
        if s < count:
            copy_weights(s * stage_bytes, first + s)
    for s in range(cfg.stages - 1):
        if s < count:
            copy_x(s * stage_bytes, first + s)

    warps = [(w % cfg.warps_n, w // cfg.warps_n) for w in range(cfg.warps_n * cfg.warps_m)]
    y = {warp: torch.zeros(4, mb, 32, 4) for warp in warps}
    for i in range(count):
        nxt = i + cfg.stages - 1
        if nxt < count:  # the refill of the stage every warp finished with (after the barrier)
            copy_weights((nxt % cfg.stages) * stage_bytes, first + nxt)
            copy_x((nxt % cfg.stages) * stage_bytes, first + nxt)
        read = (i % cfg.stages) * stage_bytes
        for wn, wm in warps:
            xrow = wm * mb * 8 + G
            w_at = T * bn * 4 + w_chunk(T, 16 * wn + G) * 16
            x_at = [w_bytes + xrow * BLOCK_K * 2 + x_chunk(xrow, T) * 16,
                    w_bytes + xrow * BLOCK_K * 2 + x_chunk(xrow, 4 + T) * 16]
            s_at = w_bytes + x_bytes + (64 * wn + 4 * G) * 2
            for s in range(2):
                if s == 0 or scale_rows == 2:
                    at = read + s_at + (s if scale_rows == 2 else 0) * bn * 2
                    sw = torch.cat([smem.load(at, 2), smem.load(at + 64, 2)], dim=1)
                    zw = torch.cat([smem.load(at + s_bytes, 2), smem.load(at + s_bytes + 64, 2)], dim=1)
                    cs2, z2 = [], []
                    for e in range(8):
                        dup = _dup(sw[:, e >> 1], bool(e & 1))  # prmt(w, 0, 0x1010 | 0x3232)
                        cs2.append(_bits((_halves(dup, dtype) * scale_c).to(dtype))[:, 0])  # hmul2 by C, exact
                        z2.append(_dup(zw[:, e >> 1], bool(e & 1)))
                w_step_at = read + w_at + s * 4 * bn * 4
                q = torch.cat([smem.load(w_step_at, 4), smem.load(w_step_at + 128, 4)], dim=1)
                xv = [smem.load(read + x_at[s] + b * 8 * BLOCK_K * 2, 4) for b in range(mb)]
                for h in range(2):
                    b0 = [prmt(v[:, 1 if h else 0], v[:, 3 if h else 2], 0x5410) for v in xv]
                    b1 = [prmt(v[:, 1 if h else 0], v[:, 3 if h else 2], 0x7632) for v in xv]
                    for j in range(4):
                        w0, w1 = q[:, 2 * j], q[:, 2 * j + 1]
                        a = [unit_pair(2 * h, w0, w0 >> 8, dtype, word), unit_pair(2 * h, w1, w1 >> 8, dtype, word),
                             unit_pair(2 * h + 1, w0, w0 >> 8, dtype, word),
                             unit_pair(2 * h + 1, w1, w1 >> 8, dtype, word)]
                        a = [dequant(a[0], offset_a, cs2[2 * j], z2[2 * j], dtype),
                             dequant(a[1], offset_a, cs2[2 * j + 1], z2[2 * j + 1], dtype),
                             dequant(a[2], one2, cs2[2 * j], z2[2 * j], dtype),
                             dequant(a[3], one2, cs2[2 * j + 1], z2[2 * j + 1], dtype)]
                        for b in range(mb):
                            y[(wn, wm)][j, b] = mma(y[(wn, wm)][j, b], a, [b0[b], b1[b]], dtype)

    for wn, wm in warps:  # the D fragments: elements (r, r + 2) are channels ch, ch + 1 of token row m
        for j in range(4):
            ch = 64 * wn + 4 * G + CHANNEL[2 * j]  # within the block
            for b in range(mb):
                for r in range(2):
                    m = wm * mb * 8 + 8 * b + 2 * T + r
                    keep = m < m_rows
                    mk, ck = m[keep], ch[keep]
                    lo, hi = y[(wn, wm)][j, b][keep, r], y[(wn, wm)][j, b][keep, r + 2]
                    if split:
                        ws[mk, ck] += lo
                        ws[mk, ck + 1] += hi
                        continue
                    if bias is not None:
                        lo, hi = lo + bias[n0 + ck].float(), hi + bias[n0 + ck + 1].float()
                    out[mk, n0 + ck], out[mk, n0 + ck + 1] = lo.to(dtype), hi.to(dtype)
                    writes[mk, n0 + ck] += 1
                    writes[mk, n0 + ck + 1] += 1
    assert n0 + bn <= n
    return smem.conflicts
