"""Tensor-core W4A16 GEMM on the transposed product: y.T = W @ x.T, the dequantized weights as the MMA's A operand.

Why transposed: on Hopper the A operand of a warpgroup MMA may come straight from registers while B must sit in shared
memory. In `w4a16_gemm` the weights are B (y = x @ W.T), so every dequantized tile makes a round trip through shared
memory before the MMA reads it. Here the weights are A: the MMA takes the dequantized tile [BLOCK_N, BLOCK_K] from
registers, and only the activations x.T [BLOCK_K, BLOCK_M] (small, loaded, never computed) must sit in shared memory.
(Triton still moves the decoded tile through shared memory when its register layout differs from the MMA fragment's,
as it does for "load", "interleave" and "asm": a thread decodes 8 consecutive k, a fragment holds k pairs 2t, 2t + 1,
2t + 8, 2t + 9; "frag" below removes that trip.) The token count is the MMA's N side, so a decode batch of 1..16 tokens
pads to 16 columns, not to 64 rows.

Decoding (`decode`):
  "load"        reads each packed int32 once per unpacked row, q[k // 8, n] (8 loads of the same word, served from
                L1) and shifts out nibble k % 8; 7 scalar TTGIR ops per weight (and, or, trunc, bitcast, sub, mul, add).
  "interleave"  loads the packed tile [BLOCK_N, BLOCK_K // 8] once and expands it in registers with three interleaves
                (shifts 16, 8, 4: index 8r + 4a + 2b + c holds the nibble at shift 16a + 8b + 4c = 4 (4a + 2b + c),
                i.e. nibble i of row r at k = 8r + i, the engine layout's order).
  "asm"         one PTX block per packed word does the decode two weights at a time, in f16x2/bf16x2:
                lop3 (q >> 4j) & 0x000F000F | magic puts nibbles j and j + 4 in the mantissas of the two halves
                (1024 + c for fp16, 128 + c for bf16), one packed sub removes the magic, one packed FMA applies scale
                and zero: 18 PTX instructions per 8 weights (plus register moves). The eight outputs are joined back into
                k order. The interpreter cannot run PTX: there (CPU tensors) a plain-Triton twin computes the same
                eight outputs and the rest of the kernel is the same, so CI checks everything but the PTX block,
                which benchmarks/gpu_kernel_tests.py checks on the GPU.
  "frag"        the "asm" decode, with each tile's k reordered within blocks of 32 so that the nibbles of one packed
                word land where a wgmma A fragment wants them: word 4 kc + t of a row goes to thread t of the quad and
                its nibble 2a + b + 4c to kp = 32 kc + 16 a + 8 b + 2 t + c (c = which half of the f16x2 register).
                The same reorder of the x.T rows (reshape + permute of the loaded tile) keeps the product exact. Triton
                then loads the packed tile from shared memory straight into the MMA layout (TTGIR: no layout
                conversion of the decoded tile). When BLOCK_N is a multiple of 16 per warp the rows are reordered
                too (`frag_rows`, undone by `memory_rows` before the store), so that a thread's fragment rows are
                consecutive in memory and the packed tile moves as 16-byte cp.async. Needs BLOCK_K and K multiples
                of 32.
  "frag-x"      "frag" with x reordered once per call (`frag_k_order`, one copy of x) instead of per tile: for many
                tokens, where the per-tile reorder of x.T (through shared memory) costs more than the copy.

Split-K (SPLIT_K > 1) reduces through the same self-cleaning workspace as the other kernels (`w4a16_epilogue`).
Reference: `w4a16_layout.w4a16_matmul_reference` (same function; tests compare against it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.pdl import pdl_options, pdl_prologue
from lmd.turbomind.kernels.w4a16_epilogue import load_tile, split_k_steps, store_tile, tile_launch_buffers
from lmd.turbomind.kernels.w4a16_gemm import nibble_as_act


@dataclass(frozen=True)
class WtGemmConfig:
    block_n: int = 64  # weight rows (output channels) per program: the MMA's M side
    block_m: int = 16  # tokens per program: the MMA's N side
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    decode: str = "load"  # one of DECODES (module docstring)

    def name(self) -> str:
        tag = {"load": "", "interleave": "-il", "asm": "-asm", "frag": "-frag", "frag-x": "-fragx"}[self.decode]
        return (f"wt{tag} n{self.block_n} m{self.block_m} k{self.block_k} s{self.split_k} w{self.num_warps} "
                f"st{self.num_stages}")


DECODES = ("load", "interleave", "asm", "frag", "frag-x")

# $0..$7: nibbles 0..7 of the word $8, dequantized with scale $9 and zero $10 (both 16-bit, act dtype)
_DECODE_PTX = """{
.reg .b32 t0, t1, t2, t3, s2, z2, m;
mov.b32 s2, {$9, $9};
mov.b32 z2, {$10, $10};
mov.b32 m, MAGIC;
lop3.b32 t0, $8, 0x000F000F, MAGIC, 0xEA;
shr.b32 t1, $8, 4;
lop3.b32 t1, t1, 0x000F000F, MAGIC, 0xEA;
shr.b32 t2, $8, 8;
lop3.b32 t2, t2, 0x000F000F, MAGIC, 0xEA;
shr.b32 t3, $8, 12;
lop3.b32 t3, t3, 0x000F000F, MAGIC, 0xEA;
SUBOP t0, t0, m;
SUBOP t1, t1, m;
SUBOP t2, t2, m;
SUBOP t3, t3, m;
fma.rn.TYPE t0, t0, s2, z2;
fma.rn.TYPE t1, t1, s2, z2;
fma.rn.TYPE t2, t2, s2, z2;
fma.rn.TYPE t3, t3, s2, z2;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}"""
DECODE_PTX_F16 = tl.constexpr(
    _DECODE_PTX.replace("MAGIC", "0x64006400").replace("SUBOP", "sub.f16x2").replace("TYPE", "f16x2"))
DECODE_PTX_BF16 = tl.constexpr(
    _DECODE_PTX.replace("MAGIC", "0x43004300").replace("SUBOP", "sub.rn.bf16x2").replace("TYPE", "bf16x2"))


@triton.jit
def _weight_tile(qw_ptr, offs_n, n_mask, ks, k_mask, step, N, K, dtype: tl.constexpr, BLOCK_K: tl.constexpr,
                 INTERLEAVE: tl.constexpr):
    """Codes of W[offs_n, ks] as exact act-dtype values 0..15, shape [BLOCK_N, BLOCK_K]."""
    if INTERLEAVE:
        rows = step * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        mask = n_mask[:, None] & (rows < K // 8)[None, :]
        q = tl.load(qw_ptr + rows[None, :] * N + offs_n[:, None], mask=mask, other=0)
        q = tl.interleave(q, q >> 16)
        q = tl.interleave(q, q >> 8)
        q = tl.interleave(q, q >> 4)
        return nibble_as_act(q, 0, dtype)
    else:
        mask = n_mask[:, None] & k_mask[None, :]
        q = tl.load(qw_ptr + (ks // 8)[None, :] * N + offs_n[:, None], mask=mask, other=0)
        return nibble_as_act(q, ((ks % 8) * 4)[None, :], dtype)


@triton.jit
def _nibble_dequant(q, i: tl.constexpr, s, z):
    """The PTX block's output i computed in plain Triton (the interpreter's twin of _DECODE_PTX)."""
    return ((q >> (4 * i)) & 0xF).to(tl.float32) * s.to(tl.float32) + z.to(tl.float32)


@triton.jit
def frag_rows(t, NW: tl.constexpr):
    """Rows of t [BLOCK_N, W] reordered so that the rows one thread holds in a wgmma A fragment (16 w + g and + 8 in
    each 64-row block, w = warp, g = lane // 4) are consecutive in memory: logical row 16 NW rep + 16 w + 8 h + g is
    memory row 2 REP (8 w + g) + 2 rep + h. The packed tile then loads with 8- or 16-byte vectors."""
    BN: tl.constexpr = t.shape[0]
    W: tl.constexpr = t.shape[1]
    REP: tl.constexpr = BN // (16 * NW)
    t = tl.permute(tl.reshape(t, (NW, 8, REP, 2, W)), (2, 0, 3, 1, 4))
    return tl.reshape(t, (BN, W))


@triton.jit
def memory_rows(t, NW: tl.constexpr):
    """The inverse of frag_rows: rows of t [BLOCK_N, W] from fragment order back to memory order."""
    BN: tl.constexpr = t.shape[0]
    W: tl.constexpr = t.shape[1]
    REP: tl.constexpr = BN // (16 * NW)
    t = tl.permute(tl.reshape(t, (REP, NW, 2, 8, W)), (1, 3, 0, 2, 4))
    return tl.reshape(t, (BN, W))


@triton.jit
def _asm_weight_tile(qw_ptr, s_ptr, z_ptr, offs_n, n_mask, step, N, K, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                     dtype: tl.constexpr, PTX: tl.constexpr, FRAG: tl.constexpr, EVEN: tl.constexpr,
                     ROWS: tl.constexpr):
    """Dequantized W[offs_n, step's K slice] in the act dtype, [BLOCK_N, BLOCK_K], decoded by _DECODE_PTX (PTX) or
    by its plain-Triton twin (interpreter): the same loads and the same joins, so CI checks all but the PTX."""
    rows = step * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    mask = n_mask[:, None] & (rows < K // 8)[None, :]
    # EVEN: N and K fill whole tiles, so no load needs predicates (fewer instructions per step)
    q = load_tile(qw_ptr + rows[None, :] * N + offs_n[:, None], mask, 0, EVEN)
    if GROUP % BLOCK_K == 0:
        g = (step * BLOCK_K) // GROUP
        s = tl.broadcast_to(load_tile(s_ptr + g * N + offs_n, n_mask, 0.0, EVEN)[:, None], q.shape)
        z = tl.broadcast_to(load_tile(z_ptr + g * N + offs_n, n_mask, 0.0, EVEN)[:, None], q.shape)
    else:
        sz_off = ((rows * 8) // GROUP)[None, :] * N + offs_n[:, None]
        s = tl.load(s_ptr + sz_off, mask=mask, other=0.0)
        z = tl.load(z_ptr + sz_off, mask=mask, other=0.0)
    if ROWS > 0:  # loaded in memory order, used in fragment order (frag_rows; ROWS = warps)
        q = frag_rows(q, ROWS)
        s = frag_rows(s, ROWS)
        z = frag_rows(z, ROWS)
    if PTX:
        if dtype == tl.float16:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                DECODE_PTX_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [q, s.to(tl.float16), z.to(tl.float16)],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                DECODE_PTX_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [q, s.to(tl.bfloat16), z.to(tl.bfloat16)],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        w0 = _nibble_dequant(q, 0, s, z).to(dtype)
        w1 = _nibble_dequant(q, 1, s, z).to(dtype)
        w2 = _nibble_dequant(q, 2, s, z).to(dtype)
        w3 = _nibble_dequant(q, 3, s, z).to(dtype)
        w4 = _nibble_dequant(q, 4, s, z).to(dtype)
        w5 = _nibble_dequant(q, 5, s, z).to(dtype)
        w6 = _nibble_dequant(q, 6, s, z).to(dtype)
        w7 = _nibble_dequant(q, 7, s, z).to(dtype)
    if FRAG:
        # join appends its selector as the fastest axis: [n, word, c, b, a] = nibble 2a + b + 4c of the word, and
        # word = 4 kc + t. The permute puts it at kp = 32 kc + 16 a + 8 b + 2 t + c: thread t's k pairs in a wgmma A
        # fragment (the x.T tile is permuted to match), so Triton can load the packed tile straight into the MMA layout
        w = tl.join(tl.join(tl.join(w0, w4), tl.join(w1, w5)), tl.join(tl.join(w2, w6), tl.join(w3, w7)))
        w = tl.reshape(w, (q.shape[0], BLOCK_K // 32, 4, 2, 2, 2))
        w = tl.permute(w, (0, 1, 5, 4, 2, 3))
        return tl.reshape(w, (q.shape[0], BLOCK_K))
    # join appends a fastest axis, so the outermost join picks bit 0 of the nibble index: [.., a, b, c] holds
    # nibble 4a + 2b + c when the innermost joins pair (i, i + 4) — the two halves of one PTX register
    w = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
    return tl.reshape(w, (q.shape[0], BLOCK_K))


@triton.jit(do_not_specialize=["M"])
def _wt_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
               GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DECODE: tl.constexpr, PTX: tl.constexpr,
               EVEN: tl.constexpr, ROWS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % tiles_m  # the M tiles of one weight tile run next to each other: the weights come from L2 after one
    pid_n = pid // tiles_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    dtype = x_ptr.dtype.element_ty
    steps = tl.cdiv(K, BLOCK_K)
    first, last = split_k_steps(pid_k, steps, SPLIT_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for step in range(first, last):
        ks = step * BLOCK_K + offs_k
        k_mask = ks < K
        if DECODE >= 2:
            w = _asm_weight_tile(qw_ptr, s_ptr, z_ptr, offs_n, n_mask, step, N, K, GROUP, BLOCK_K, dtype, PTX,
                                 DECODE >= 3, EVEN, ROWS)
        else:
            codes = _weight_tile(qw_ptr, offs_n, n_mask, ks, k_mask, step, N, K, dtype, BLOCK_K, DECODE == 1)
            if GROUP % BLOCK_K == 0:
                g = (step * BLOCK_K) // GROUP
                s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(dtype)[:, None]
                z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(dtype)[:, None]
            else:
                sz_off = (ks // GROUP)[None, :] * N + offs_n[:, None]
                sz_mask = n_mask[:, None] & k_mask[None, :]
                s = tl.load(s_ptr + sz_off, mask=sz_mask, other=0.0).to(dtype)
                z = tl.load(z_ptr + sz_off, mask=sz_mask, other=0.0).to(dtype)
            w = codes * s + z
        # rows past M stay masked even on whole tiles
        x_mask = m_mask[None, :] if EVEN else k_mask[:, None] & m_mask[None, :]
        xt = tl.load(x_ptr + offs_m[None, :] * K + ks[:, None], mask=x_mask, other=0.0)
        if DECODE == 3:  # rows into the weights' fragment order: k = 32 kc + 8 t + 4 c + 2 a + b -> kp (see above)
            xt = tl.reshape(xt, (BLOCK_K // 32, 4, 2, 2, 2, BLOCK_M))
            xt = tl.reshape(tl.permute(xt, (0, 3, 4, 1, 2, 5)), (BLOCK_K, BLOCK_M))
        acc = tl.dot(w, xt, acc)
    tile_id = pid_n * tiles_m + pid_m
    if ROWS > 0:  # acc's rows are in fragment order; stores and split-K atomics want them contiguous
        acc = memory_rows(acc, ROWS)
    store_tile(tl.trans(acc), offs_m, offs_n, M, N, out_ptr, bias_ptr, ws_ptr, cnt_ptr, tile_id, HAS_BIAS, SPLIT_K)


def frag_k_order(x2d: torch.Tensor) -> torch.Tensor:
    """x [M, K] with its columns in the frag decode's k order (kp = 32 kc + 16 a + 8 b + 2 t + c holds
    k = 32 kc + 8 t + 4 c + 2 a + b): a copy, for "frag-x", which then reads x.T tiles as they are."""
    m, k = x2d.shape
    return x2d.view(m, k // 32, 4, 2, 2, 2).permute(0, 1, 4, 5, 2, 3).reshape(m, k)


def frag_row_warps(cfg: WtGemmConfig) -> int:
    """The ROWS argument: the warp count when the frag decode also reorders rows (BLOCK_N a multiple of 16 per warp),
    else 0."""
    return cfg.num_warps if cfg.decode.startswith("frag") and cfg.block_n % (16 * cfg.num_warps) == 0 else 0


def gemm_wt(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            bias: torch.Tensor | None, cfg: WtGemmConfig) -> torch.Tensor:
    """x2d [M, K] contiguous -> [M, N] in x's dtype."""
    if cfg.decode not in DECODES:
        raise ValueError(f"decode {cfg.decode!r}: expected one of {DECODES}")
    if cfg.decode.startswith("frag") and (cfg.block_k % 32 or x2d.shape[1] % 32):
        raise ValueError(f"decode {cfg.decode!r} permutes k within blocks of 32: BLOCK_K={cfg.block_k} and "
                         f"K={x2d.shape[1]} must be multiples of 32")
    if cfg.decode == "frag-x":
        x2d = frag_k_order(x2d)
    m, n, k, group, tiles, out, ws, cnt = tile_launch_buffers(x2d, qweight, scales, cfg.block_m, cfg.block_n,
                                                              cfg.split_k)
    _wt_kernel[(tiles, cfg.split_k)](
        x2d, qweight, scales, zeros, bias if bias is not None else out, out, ws, cnt, m, n, k,
        GROUP=group, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, DECODE=DECODES.index(cfg.decode), PTX=x2d.is_cuda,
        EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0, ROWS=frag_row_warps(cfg), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_options(x2d.device))
    return out
