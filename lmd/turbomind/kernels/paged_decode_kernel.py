"""Decode attention for one query head per KV head (MHA: Llama-2), float KV, on CUDA cores.

`_attention_kernel` runs a decode tile through tl.dot, which needs 16 rows: with one query head per KV head, 15 of
them are padding, and the accumulator, the query and the scores of those rows hold registers that limit how many
programs share an SM (the batch-64 step's 2,048 programs then ran in 1.72 waves, docs/benchmarks.md). Here a program
holds one query row: scores are q . k reduced across the head dim, the output p @ V reduced across the keys, both
in fp32 on CUDA cores (a decode reads 2 x D values a key and does 2 x D multiply-adds with them: memory-bound
either way). Grid (decode tiles, KV heads, splits), the same partial layout as `_attention_kernel`'s, so
`_combine_kernel` merges the splits.

When BLOCK_N divides BLOCK_SIZE every step's keys sit in one cache block (a split starts at a multiple of BLOCK_N),
so a step reads one block id, not one a key. P is not rounded to the compute dtype before P @ V (the dot path
rounds it): this path is the closer of the two to the fp32 reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lmd.turbomind.kernels.pdl import pdl_prologue


@triton.jit
def _key_offsets(table_ptr, start, keys, key_ok, stride_cb, stride_ct, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Offsets [BLOCK_N] int64 of `keys` (start .. start + BLOCK_N of one sequence) in the cache."""
    in_block = (keys % BLOCK_SIZE).to(tl.int64)
    if BLOCK_SIZE % BLOCK_N == 0:
        block = tl.load(table_ptr + start // BLOCK_SIZE).to(tl.int64)
    elif MASKED:
        block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    else:
        block = tl.load(table_ptr + keys // BLOCK_SIZE).to(tl.int64)
    return block * stride_cb + in_block * stride_ct


@triton.jit
def _decode_mha_kernel(
    q_ptr,
    out_ptr,
    part_ptr,
    part_ml_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    seq_info_ptr,
    tiles_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    stride_cb,
    stride_ct,
    stride_ch,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    tile = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1)
    seq = tl.load(tiles_ptr + 2 * tile)
    token = tl.load(seq_info_ptr + 3 * seq).to(tl.int64)
    ctx = tl.load(seq_info_ptr + 3 * seq + 2)
    table_ptr = tables_ptr + seq.to(tl.int64) * stride_table
    offs_d = tl.arange(0, HEAD_DIM)
    # the scale (log2 e folded in) goes on q once, not on every score
    q = tl.load(q_ptr + token * stride_qt + head * stride_qh + offs_d).to(tl.float32) * qk_scale

    per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), SPLITS) * BLOCK_N
    lo = tl.minimum(split * per_split, ctx)
    hi = tl.minimum(lo + per_split, ctx)
    full_end = lo + ((hi - lo) // BLOCK_N) * BLOCK_N
    k_ptr += head * stride_ch
    v_ptr += head * stride_ch

    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    # running max and sum as scalars: a key tile's max and sum are reductions to one value
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    for phase in tl.static_range(2):  # 0: whole tiles, unmasked; 1: the split's last partial tile, masked
        if phase == 0:
            first, end = lo, full_end
        else:
            first, end = full_end, hi
        for start in range(first, end, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < hi
            rows = _key_offsets(table_ptr, start, keys, key_ok, stride_cb, stride_ct, BLOCK_SIZE, BLOCK_N,
                                phase == 1)
            ptrs = rows[:, None] + offs_d[None, :]
            if phase == 1:
                k = tl.load(k_ptr + ptrs, mask=key_ok[:, None], other=0.0)
                v = tl.load(v_ptr + ptrs, mask=key_ok[:, None], other=0.0)
            else:
                k = tl.load(k_ptr + ptrs)
                v = tl.load(v_ptr + ptrs)
            qk = tl.sum(k.to(tl.float32) * q[None, :], 1)
            if phase == 1:
                qk = tl.where(key_ok, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 0))  # finite: every tile holds at least one key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new)
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
            m_i = m_new

    if SPLITS == 1:
        out = acc / l_i
        tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))
    else:
        # an empty split (lo == ctx) writes max = -inf, sum = 0: the combine adds nothing from it
        slot = ((tile * num_heads + head) * SPLITS + split).to(tl.int64)
        tl.store(part_ptr + slot * HEAD_DIM + offs_d, acc)
        tl.store(part_ml_ptr + 2 * slot, m_i)
        tl.store(part_ml_ptr + 2 * slot + 1, l_i)
