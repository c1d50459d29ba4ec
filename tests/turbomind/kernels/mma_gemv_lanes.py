"""A lane-level emulation of the CUDA kernel in `w4a16_mma_gemv.SOURCE`, for CI machines without a GPU.

It follows the source statement by statement, vectorized over the 32 lanes of a warp: the same load addresses, the
same shifts, masks, PRMT selectors and 1.0 bits, `mma.sync.m16n8k16` through the fragment layout the PTX ISA
specifies (A: a0 = row g cols 2t..2t+1, a1 = row g+8, a2 = row g cols 2t+8.., a3 = row g+8 cols 2t+8..; B: b0 = rows
2t..2t+1 col g, b1 = rows 2t+8..; C/D: c0, c1 = row g cols 2t..2t+1, c2, c3 = row g+8), the per-group fold, the
warps' shared-memory sum and the split-K workspace. What it checks is the kernel's index and bit plan; that the
CUDA text says the same is the GPU probe's job (`benchmarks/w4a16_mma_probe.py`).
"""

from __future__ import annotations

import torch

from lmd.turbomind.kernels.w4a16_mma_gemv import BLOCK_N, MmaGemvConfig, word_decode

LANES = torch.arange(32)
G, T = LANES >> 2, LANES & 3
U32 = 0xFFFFFFFF
CHANNEL = torch.tensor([0, 1, 2, 3, 32, 33, 34, 35])  # word e's channel from the thread's col (channel() in the .cu)


def _bits(halves: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 tensor [..., 2k] -> uint32 words [..., k] (int64), element 2i in the low half."""
    h = halves.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    return h[..., 0::2] | (h[..., 1::2] << 16)


def _halves(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint32 words [...] -> float32 [..., 2] (low half first)."""
    h = torch.stack([words & 0xFFFF, (words >> 16) & 0xFFFF], dim=-1).to(torch.int16)
    return h.view(dtype).to(torch.float32)


def prmt(a: torch.Tensor, b: torch.Tensor, sel: int) -> torch.Tensor:
    """PTX prmt.b32 (default mode): result byte k = byte (sel >> 4k) & 7 of the 8 bytes {b, a} (a = bytes 0-3)."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = torch.zeros_like(a)
    for k in range(4):
        out |= pool[(sel >> (4 * k)) & 7] << (8 * k)
    return out


def mma(c: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """mma.sync.aligned.m16n8k16.row.col.f32: c [32, 4] fp32, a 4 and b 2 registers per lane -> d [32, 4]."""
    A = torch.zeros(16, 16)
    B = torch.zeros(16, 8)
    C = torch.zeros(16, 8)
    cols = 2 * T[:, None] + torch.arange(2)  # [32, 2]
    A[G[:, None], cols] = _halves(a[0], dtype)
    A[G[:, None] + 8, cols] = _halves(a[1], dtype)
    A[G[:, None], cols + 8] = _halves(a[2], dtype)
    A[G[:, None] + 8, cols + 8] = _halves(a[3], dtype)
    B[cols, G[:, None]] = _halves(b[0], dtype)
    B[cols + 8, G[:, None]] = _halves(b[1], dtype)
    C[G[:, None], cols] = c[:, 0:2]
    C[G[:, None] + 8, cols] = c[:, 2:4]
    D = A @ B + C
    return torch.cat([D[G[:, None], cols], D[G[:, None] + 8, cols]], dim=1)


def unit_pair(i: int, q: torch.Tensor, q8: torch.Tensor, dtype: torch.dtype, word: bool) -> torch.Tensor:
    if word:
        src = q if i < 2 else q8
        return (src & 0x000F000F) | 0x4C004C00 if i % 2 == 0 else (src & 0x00F000F0) | 0x3C003C00
    bit, mask, one = (3, 0x00780078, 0x3F803F80) if dtype == torch.bfloat16 else (6, 0x03C003C0, 0x3C003C00)
    shift = bit - 4 * i
    t = ((q << shift) & U32) if shift >= 0 else (q >> -shift)
    return (t & mask) | one


def dequant(v: torch.Tensor, offset: int, cs: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(v - offset) * cs + z on both halves, rounded once to dtype (sub is exact, fma rounds once): words [L]."""
    hv, ho = _halves(v, dtype).double(), _halves(torch.tensor(offset, dtype=torch.int64), dtype).double()
    hc, hz = _halves(cs, dtype).double(), _halves(z, dtype).double()
    w = ((hv - ho) * hc + hz).float().to(dtype)
    return _bits(w.reshape(-1, 2))[:, 0]


def decode_constants(dtype: torch.dtype, word: bool) -> tuple[int, int, float]:
    """(ONE2: 1.0 in both halves; the offset of the pairs in fragment columns 2t, 2t + 1; C) as the sources set them."""
    one2 = 0x3F803F80 if dtype == torch.bfloat16 else 0x3C003C00
    return (one2, 0x4C004C00, 64.0) if word else (one2, one2, 16.0)


def as_words(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
             ) -> tuple[torch.Tensor, ...]:
    """The operands as the kernels load them, 32-bit words (int64): packed qweight, x [M, K/2], scales and zeros
    [G, N/2]."""
    return qweight.to(torch.int64) & U32, _bits(x), _bits(scales), _bits(zeros)


def _dup(half_words: torch.Tensor, high: bool) -> torch.Tensor:
    """prmt(w, 0, 0x3232 | 0x1010): the high or low half of each word in both halves."""
    h = (half_words >> 16) & 0xFFFF if high else half_words & 0xFFFF
    return h | (h << 16)


def run(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
        bias: torch.Tensor | None, cfg: MmaGemvConfig) -> torch.Tensor:
    """What the kernel computes for x [M, K] (fp16/bf16), as the host wrapper `mma_gemv` launches it."""
    out = torch.empty(x.shape[0], qweight.shape[1], dtype=x.dtype)
    for m0 in range(0, x.shape[0], cfg.block_m):  # grid x: token tiles
        out[m0:m0 + cfg.block_m] = _token_tile(x[m0:m0 + cfg.block_m], qweight, scales, zeros, bias, cfg)
    return out


def _token_tile(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: torch.Tensor | None, cfg: MmaGemvConfig) -> torch.Tensor:
    dtype = x.dtype
    m_rows, k = x.shape
    n = qweight.shape[1]
    group = k // scales.shape[0]
    gsteps, mb, warps = group // 32, cfg.block_m // 8, cfg.warps
    scaled = mb >= 4
    word = word_decode(dtype, cfg)
    one2, offset_a, scale_c = decode_constants(dtype, word)
    groups = k // group
    per_cta = warps * cfg.groups_per_warp
    split = -(-groups // per_cta)
    q_all, x_words, s_words, z_words = as_words(x, qweight, scales, zeros)
    ws = torch.zeros(m_rows, n)
    out = torch.empty(m_rows, n, dtype=dtype)
    zero4 = torch.zeros(32, 4, dtype=torch.int64)

    def x_step(m: torch.Tensor, k0: torch.Tensor) -> torch.Tensor:  # load_x_step: 4 words a lane, zeros past M
        words = x_words[m.clamp(max=m_rows - 1)[:, None], (k0 // 2)[:, None] + torch.arange(4)]
        return torch.where((m < m_rows)[:, None], words, zero4)

    for block in range(n // BLOCK_N):  # grid y: 64-channel blocks
        col = block * 64 + 4 * G  # [32]
        for split_index in range(split):  # grid z: K splits
            first = split_index * per_cta
            end = min(first + per_cta, groups)
            red = torch.zeros(warps, mb * 8, 64)
            for warp in range(warps):
                y = torch.zeros(mb, 4, 32, 4)
                for gi in range(first + warp, end, warps):
                    q = [q_all[(gi * gsteps * 4 + s * 4 + T)[:, None], col[:, None] + CHANNEL]
                         for s in range(gsteps)]  # [32, 8] words a step
                    xv = [[x_step(b * 8 + G, gi * gsteps * 32 + s * 32 + 8 * T) for s in range(gsteps)]
                          for b in range(mb)]
                    # two 8-byte loads each: words of channels col .. col + 3 and col + 32 .. col + 35
                    s_lo = torch.cat([s_words[gi, (col // 2)[:, None] + torch.arange(2)],
                                      s_words[gi, (col // 2 + 16)[:, None] + torch.arange(2)]], dim=1)
                    z_lo = torch.cat([z_words[gi, (col // 2)[:, None] + torch.arange(2)],
                                      z_words[gi, (col // 2 + 16)[:, None] + torch.arange(2)]], dim=1)
                    sc = _halves(s_lo, dtype).reshape(32, 8)
                    zr = _halves(z_lo, dtype).reshape(32, 8)
                    if scaled:
                        cs2 = [_bits((scale_c * sc[:, e]).to(dtype).repeat_interleave(2).reshape(32, 2))[:, 0]
                               for e in range(8)]
                        z2 = [_dup(z_lo[:, e >> 1], bool(e & 1)) for e in range(8)]
                    d = torch.zeros(mb, 4, 32, 4)
                    xs = torch.zeros(mb, 32, 4)
                    for s in range(gsteps):
                        for h in range(2):
                            b0, b1 = [], []
                            for b in range(mb):
                                lo = xv[b][s][:, 1 if h else 0]
                                hi = xv[b][s][:, 3 if h else 2]
                                b0.append(prmt(lo, hi, 0x5410))
                                b1.append(prmt(lo, hi, 0x7632))
                                if not scaled:
                                    ones = [torch.full((32,), v, dtype=torch.int64)
                                            for v in (offset_a, one2, one2, one2)]
                                    xs[b] = mma(xs[b], ones, [b0[b], b1[b]], dtype)
                            for j in range(4):
                                w0, w1 = q[s][:, 2 * j], q[s][:, 2 * j + 1]
                                w08, w18 = w0 >> 8, w1 >> 8
                                a = [unit_pair(2 * h, w0, w08, dtype, word), unit_pair(2 * h, w1, w18, dtype, word),
                                     unit_pair(2 * h + 1, w0, w08, dtype, word),
                                     unit_pair(2 * h + 1, w1, w18, dtype, word)]
                                if scaled:
                                    a = [dequant(a[0], offset_a, cs2[2 * j], z2[2 * j], dtype),
                                         dequant(a[1], offset_a, cs2[2 * j + 1], z2[2 * j + 1], dtype),
                                         dequant(a[2], one2, cs2[2 * j], z2[2 * j], dtype),
                                         dequant(a[3], one2, cs2[2 * j + 1], z2[2 * j + 1], dtype)]
                                for b in range(mb):
                                    if scaled:
                                        y[b, j] = mma(y[b, j], a, [b0[b], b1[b]], dtype)
                                    else:
                                        d[b, j] = mma(d[b, j], a, [b0[b], b1[b]], dtype)
                    if scaled:
                        continue
                    for j in range(4):
                        for r in range(2):
                            e = 2 * j + r
                            cs = scale_c * sc[:, e]
                            for b in range(mb):
                                y[b, j, :, 2 * r] += cs * (d[b, j, :, 2 * r] - xs[b, :, 0]) + zr[:, e] * xs[b, :, 2]
                                y[b, j, :, 2 * r + 1] += (cs * (d[b, j, :, 2 * r + 1] - xs[b, :, 1])
                                                          + zr[:, e] * xs[b, :, 3])
                for b in range(mb):
                    for j in range(4):
                        for e in range(4):
                            red[warp, b * 8 + 2 * T + (e & 1), 4 * G + CHANNEL[2 * j + (e >> 1)]] = y[b, j, :, e]
            total = red.sum(dim=0)[:m_rows]  # [M, 64]
            cols = block * 64 + torch.arange(64)
            if split > 1:
                ws[:, cols] += total
            else:
                v = total + (bias[cols].float() if bias is not None else 0.0)
                out[:, cols] = v.to(dtype)
        if split > 1:
            cols = block * 64 + torch.arange(64)
            out[:, cols] = (ws[:, cols] + (bias[cols].float() if bias is not None else 0.0)).to(dtype)
    return out
