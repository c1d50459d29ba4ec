"""The paged-attention kernels. K/V tiles are read straight from the block pool through each sequence's block table
(int32 ids, int64 offsets: a pool of many GiB overflows int32) and folded into an online softmax (exp2 domain, fp32
accumulators; P is rounded to the compute dtype before P @ V, as in flash attention).

    _attention_kernel  grid (tiles, KV heads, splits). A tile is (sequence, first query token): BLOCK_M rows = BLOCK_M
                       // G_ROWS query tokens x G_ROWS rows per token, the GQA group's query heads padded to a power
                       of two, so K/V are read once per group. Prefill chunks: BLOCK_M = 64 or so, SPLITS = 1;
                       decodes: one token per tile (G_ROWS = BLOCK_M >= 16 rows for tl.dot) and the context split
                       into SPLITS contiguous slices (flash-decoding), each writing a partial (acc, max, sum)
    _combine_kernel    grid (decode tiles, query heads): merges the splits' partials

A tile's keys are its sequence's cached tokens plus the causal part of its own: query token j of a chunk of n sits at
position ctx - n + j and sees keys 0 .. ctx - n + j. seq_info [B, 3] int32 holds per sequence its first row in the flat
batch, query length and context length; tiles [num_tiles, 2] int32 (sequence, first query token).

KV_MODE: 0 = cache in the compute dtype; 1 = int8 codes with static (scale, zero) per KV head and channel, given as a
[4, Hkv, D] fp32 table (k_scale, k_zero, v_scale, v_zero); 2 = int8 codes with online fp16 (scale, zero) per token
and head stored beside the codes ([blocks, block, Hkv, 2]). The int8 codes are not dequantized element by element:
they are converted (exactly) to the compute dtype and the dots run on them, with the affine maps folded around the
dots: static keys by scaling q per channel and adding q . zero; online keys by scaling each key's column of q . c and
adding zero_key * sum(q); online values by scaling P per key and adding P . zero_key; static values by one per-channel
map of the accumulator after the loop. A key or value element costs one conversion, not a multiply-add and two
conversions (the cost that made int8 KV slower than fp16 KV: docs/benchmarks.md). The rounding differs from the
PyTorch reference's (dequantize, round to the compute dtype, then the dots) by about one compute-dtype rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lmd.turbomind.kernels.pdl import pdl_prologue


@triton.jit
def _key_rows(
    table_ptr, keys, key_ok, stride_cb, stride_ct, stride_pb, stride_pt, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr
):
    """Offsets of `keys` (token positions of one sequence) in the cache and in the online params, int64 [BLOCK_N]."""
    if MASKED:
        block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    else:
        block = tl.load(table_ptr + keys // BLOCK_SIZE).to(tl.int64)
    in_block = (keys % BLOCK_SIZE).to(tl.int64)
    return block * stride_cb + in_block * stride_ct, block * stride_pb + in_block * stride_pt


@triton.jit
def _kv_tile(cache_ptr, rows, key_ok, offs_d, MASKED: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """K or V rows [BLOCK_N, D] as stored (float, or int8 codes converted exactly) in OUT_DTYPE; cache_ptr points at
    the KV head."""
    ptrs = cache_ptr + rows[:, None] + offs_d[None, :]
    x = tl.load(ptrs, mask=key_ok[:, None], other=0) if MASKED else tl.load(ptrs)
    return x.to(OUT_DTYPE)


@triton.jit
def _token_params(param_ptr, param_rows, key_ok, MASKED: tl.constexpr):
    """Online int8: each key's (scale, zero) [BLOCK_N] in fp32 (param_ptr points at the KV head)."""
    params = param_ptr + param_rows
    if MASKED:
        s = tl.load(params, mask=key_ok, other=0.0).to(tl.float32)
        z = tl.load(params + 1, mask=key_ok, other=0.0).to(tl.float32)
    else:
        s = tl.load(params).to(tl.float32)
        z = tl.load(params + 1).to(tl.float32)
    return s, z


@triton.jit
def _attention_kernel(
    q_ptr,
    out_ptr,
    part_ptr,
    part_ml_ptr,
    k_ptr,
    v_ptr,
    kp_ptr,
    vp_ptr,
    static_ptr,
    tables_ptr,
    seq_info_ptr,
    tiles_ptr,
    qk_scale,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_pb,
    stride_pt,
    stride_ph,
    GROUP: tl.constexpr,
    G_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_MODE: tl.constexpr,
    SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tiles_ptr + 2 * tile)
    q0 = tl.load(tiles_ptr + 2 * tile + 1)
    q_start = tl.load(seq_info_ptr + 3 * seq)
    q_len = tl.load(seq_info_ptr + 3 * seq + 1)
    ctx = tl.load(seq_info_ptr + 3 * seq + 2)
    table_ptr = tables_ptr + seq.to(tl.int64) * stride_table

    rows = tl.arange(0, BLOCK_M)
    tok = q0 + rows // G_ROWS
    head = kv_head * GROUP + rows % G_ROWS
    row_ok = (tok < q_len) & (rows % G_ROWS < GROUP)
    offs_d = tl.arange(0, HEAD_DIM)
    token = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    # padding rows (tok >= q_len) get positions >= ctx: they see every key and are never stored
    first_pos = ctx - q_len + q0
    q_pos = first_pos + rows // G_ROWS
    key_end = tl.minimum(first_pos + BLOCK_M // G_ROWS, ctx)  # one past the last key any row of the tile sees
    per_split = tl.cdiv(tl.cdiv(key_end, BLOCK_N), SPLITS) * BLOCK_N
    lo = tl.minimum(split * per_split, key_end)
    hi = tl.minimum(lo + per_split, key_end)
    # keys below first_pos + 1 are visible to every row: whole tiles of them run without masks or bounds checks
    full_end = lo + (tl.maximum(tl.minimum(hi, first_pos + 1) - lo, 0) // BLOCK_N) * BLOCK_N

    k_ptr += kv_head * stride_ch
    v_ptr += kv_head * stride_ch
    kp_ptr += kv_head * stride_ph
    vp_ptr += kv_head * stride_ph
    # int8: the dots run on the codes (converted exactly) and the affine maps are folded around them, so a key or
    # value element costs one conversion instead of a dequantization (see the module docstring)
    qf = q.to(tl.float32)
    if KV_MODE == 1:
        static = static_ptr + kv_head * HEAD_DIM + offs_d
        plane = num_kv_heads * HEAD_DIM
        ks, kz = tl.load(static), tl.load(static + plane)
        vs, vz = tl.load(static + 2 * plane), tl.load(static + 3 * plane)
        q_dot = (qf * ks[None, :]).to(q.dtype)  # q . (c * s + z) = (q * s) . c + q . z
        q_off = tl.sum(qf * kz[None, :], 1)
    else:
        vs = tl.full([HEAD_DIM], 1.0, tl.float32)
        vz = vs
        q_dot = q
        q_off = tl.sum(qf, 1)  # online int8: q . (c * s_key + z_key) = s_key (q . c) + z_key sum(q)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for phase in tl.static_range(2):  # 0: the whole tiles every row sees, unmasked; 1: the rest, masked
        if phase == 0:
            first, end = lo, full_end
        else:
            first, end = full_end, hi
        for start in range(first, end, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < hi
            krows, prows = _key_rows(
                table_ptr, keys, key_ok, stride_cb, stride_ct, stride_pb, stride_pt, BLOCK_SIZE, phase == 1
            )
            k = _kv_tile(k_ptr, krows, key_ok, offs_d, phase == 1, q.dtype)
            qk = tl.dot(q_dot, tl.trans(k), input_precision=DOT_PRECISION)
            if KV_MODE == 1:
                qk += q_off[:, None]
            elif KV_MODE == 2:
                k_s, k_z = _token_params(kp_ptr, prows, key_ok, phase == 1)
                qk = qk * k_s[None, :] + q_off[:, None] * k_z[None, :]
            qk = qk * qk_scale
            if phase == 1:
                qk = tl.where(key_ok[None, :] & (keys[None, :] <= q_pos[:, None]), qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # a row that has seen no key yet (all masked so far) keeps m = -inf, l = 0, acc = 0: subtract 0, not -inf
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(qk - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _kv_tile(v_ptr, krows, key_ok, offs_d, phase == 1, q.dtype)
            if KV_MODE == 2:  # p @ (c * s_key + z_key) = (p * s_key) @ c + (p . z_key)
                v_s, v_z = _token_params(vp_ptr, prows, key_ok, phase == 1)
                pv = tl.dot((p * v_s[None, :]).to(v.dtype), v, input_precision=DOT_PRECISION)
                pv += tl.sum(p * v_z[None, :], 1)[:, None]
            else:  # float, or static int8 (its per-channel map is applied once, after the loop)
                pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    if KV_MODE == 1:  # sum_n p_n (c_n * s + z) = (sum_n p_n c_n) * s + l * z, per channel
        acc = acc * vs[None, :] + l_i[:, None] * vz[None, :]

    if SPLITS == 1:
        out = acc / l_i[:, None]
        out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # one query token per tile: partial acc (unnormalized) [tiles, Hq, SPLITS, D] and (max, sum) [tiles, Hq,
        # SPLITS, 2]; an empty split (lo == key_end) writes max = -inf, sum = 0 and adds nothing in the combine
        slot = ((tile * num_kv_heads * GROUP + head) * SPLITS + split).to(tl.int64)
        tl.store(part_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + 2 * slot, m_i, mask=row_ok)
        tl.store(part_ml_ptr + 2 * slot + 1, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(
    part_ptr,
    part_ml_ptr,
    out_ptr,
    seq_info_ptr,
    tiles_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    tile = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < SPLITS
    slot = ((tile * num_heads + head) * SPLITS + s).to(tl.int64)
    m = tl.load(part_ml_ptr + 2 * slot, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + 2 * slot + 1, mask=s_ok, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # split 0 always holds key 0, so the max is finite
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    seq = tl.load(tiles_ptr + 2 * tile)
    token = tl.load(seq_info_ptr + 3 * seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))
