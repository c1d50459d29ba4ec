"""Decode attention for one query head per KV head (MHA: Llama-2) on CUDA cores, over a float or int8 cache.

`_attention_kernel` runs a decode tile through tl.dot, which needs 16 rows: with one query head per KV head, 15 of
them are padding, and the accumulator, the query and the scores of those rows hold registers that limit how many
programs share an SM (the batch-64 step's 2,048 programs then ran in 1.72 waves, docs/benchmarks.md). Here a program
holds one query row: scores are q . k reduced across the head dim, the output p @ V reduced across the keys, both
in fp32 on CUDA cores (a decode reads 2 x D values a key and does 2 x D multiply-adds with them: memory-bound
either way). Grid (decode tiles, KV heads, splits), the same partial layout as `_attention_kernel`'s, so
`_combine_kernel` merges the splits.

KV_MODE is the dot kernel's (paged_attention_kernels): 0 float, 1 int8 codes with a static [4, H, D] table, 2 int8
codes with online fp16 (scale, zero) per token and head. The codes are converted, not dequantized: the affine maps
are folded around the two sums as there (a key or value element costs one conversion and one multiply-add, as a
float one does, for half the bytes).

With ROPE the kernel also does the rotary kernel's work for its (sequence, head) (kernels/rotary.py): q points at
the fused projection [T, 3 H D], the program rotates its query row and the new token's key, stores the new key and
value at the token's cache slot (int8: quantized as `rotary_qkv_triton` or `KVCache.write` quantizes them, online
params stored beside), attends over the keys cached before it and folds the new key in from registers last, as the
loop would read it back (no read of what it just wrote). The query and key are rounded to the compute dtype before
use, as the two-kernel path stores them. In a split launch every split rotates the query; the last one stores the
new key and value and folds them in (its range ends where the cached keys do). A decode step at batch 64 saves the
rotary launch of every layer (~2.4 µs on the H200, docs/benchmarks.md).

When BLOCK_N divides BLOCK_SIZE every step's keys sit in one cache block (a split starts at a multiple of BLOCK_N),
so a step reads one block id, not one a key. P is not rounded to the compute dtype before P @ V (the dot path
rounds it): this path is the closer of the two to the fp32 reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lmd.turbomind.kernels.paged_attention_kernels import _token_params
from lmd.turbomind.kernels.pdl import pdl_prologue
from lmd.turbomind.kernels.rotary import int8_codes, online_int8


@triton.jit
def _key_offsets(table_ptr, start, keys, key_ok, stride_cb, stride_ct, stride_pb, stride_pt, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Offsets [BLOCK_N] int64 of `keys` (start .. start + BLOCK_N of one sequence) in the cache and in the online
    int8 params."""
    in_block = (keys % BLOCK_SIZE).to(tl.int64)
    if BLOCK_SIZE % BLOCK_N == 0:
        block = tl.load(table_ptr + start // BLOCK_SIZE).to(tl.int64)
    elif MASKED:
        block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    else:
        block = tl.load(table_ptr + keys // BLOCK_SIZE).to(tl.int64)
    return block * stride_cb + in_block * stride_ct, block * stride_pb + in_block * stride_pt


@triton.jit
def _rotated(row_ptr, offs_d, cos, sin, ROT: tl.constexpr):
    """One head's row [D] rotated over its first ROT channels (rotate_half), in fp32: the rotary kernel's formula."""
    half: tl.constexpr = ROT // 2
    rot = offs_d < ROT
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
    x = tl.load(row_ptr + offs_d).to(tl.float32)
    xp = tl.load(row_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    sign = tl.where(offs_d < half, -1.0, 1.0)
    return tl.where(rot, x * cos + (sign * sin) * xp, x)


@triton.jit
def _store_new(x, cache_ptr, param_ptr, row, param_row, offs_d, static_scale, static_zero, stored_dims,
               KV_MODE: tl.constexpr):
    """Store the new token's key or value x [D] (fp32 holding compute-dtype values) at its cache row if
    `stored_dims` is D (0: another program of a split launch stores it); returns what the loop would read back for
    it, as [1, D] codes or values, and its online (scale, zero) [1] (ones and zeros otherwise)."""
    xf = x[None, :]
    if KV_MODE == 0:
        stored = xf.to(cache_ptr.dtype.element_ty)
        s = tl.full([1], 1.0, tl.float32)
        z = tl.full([1], 0.0, tl.float32)
    elif KV_MODE == 1:
        stored = int8_codes(xf, static_scale[None, :], static_zero[None, :])
        s = tl.full([1], 1.0, tl.float32)
        z = tl.full([1], 0.0, tl.float32)
    else:
        stored, s, z = online_int8(xf, offs_d[None, :] >= 0)
        one = tl.arange(0, 1)
        tl.store(param_ptr + param_row + one, s.to(tl.float16), mask=one < stored_dims)
        tl.store(param_ptr + param_row + 1 + one, z.to(tl.float16), mask=one < stored_dims)
    tl.store(cache_ptr + row + offs_d[None, :], stored, mask=offs_d[None, :] < stored_dims)
    return stored.to(tl.float32), s, z


@triton.jit
def _decode_mha_kernel(
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
    cos_ptr,
    sin_ptr,
    slots_ptr,
    qk_scale,
    stride_cs,
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
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLITS: tl.constexpr,
    KV_MODE: tl.constexpr,
    ROPE: tl.constexpr,
    ROT: tl.constexpr,
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
    q_row = q_ptr + token * stride_qt + head * stride_qh
    k_ptr += head * stride_ch
    v_ptr += head * stride_ch
    kp_ptr += head * stride_ph
    vp_ptr += head * stride_ph
    if KV_MODE == 1:  # the [4, H, D] table: k_scale, k_zero, v_scale, v_zero per channel
        static = static_ptr + head * HEAD_DIM + offs_d
        plane = num_heads * HEAD_DIM
        ks, kz = tl.load(static), tl.load(static + plane)
        vs, vz = tl.load(static + 2 * plane), tl.load(static + 3 * plane)
    else:
        ks = tl.zeros([HEAD_DIM], tl.float32)  # unread
        kz = ks
        vs = ks
        vz = ks
    if ROPE:  # q_row is the head's query in the fused projection: its key and value sit H and 2 H heads on
        cos = tl.load(cos_ptr + token * stride_cs + offs_d, mask=offs_d < ROT, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_cs + offs_d, mask=offs_d < ROT, other=0.0).to(tl.float32)
        q = _rotated(q_row, offs_d, cos, sin, ROT).to(out_ptr.dtype.element_ty).to(tl.float32)
        k_new = _rotated(q_row + num_heads * stride_qh, offs_d, cos, sin, ROT).to(out_ptr.dtype.element_ty)
        v_new = tl.load(q_row + 2 * num_heads * stride_qh + offs_d)
        slot = tl.load(slots_ptr + token)
        new_row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
        new_param = (slot // BLOCK_SIZE) * stride_pb + (slot % BLOCK_SIZE) * stride_pt
        stored = tl.where(split == SPLITS - 1, HEAD_DIM, 0)  # the last split stores the new key and value
        k_new, k_new_s, k_new_z = _store_new(k_new.to(tl.float32), k_ptr, kp_ptr, new_row, new_param, offs_d, ks, kz,
                                             stored, KV_MODE)
        v_new, v_new_s, v_new_z = _store_new(v_new.to(tl.float32), v_ptr, vp_ptr, new_row, new_param, offs_d, vs, vz,
                                             stored, KV_MODE)
        cached = ctx - 1  # the keys before the new one; it is folded in after the loop
    else:
        q = tl.load(q_row + offs_d).to(tl.float32)
        cached = ctx
    q = q * qk_scale  # the scale (log2 e folded in) on q once, not on every score
    # int8: the affine maps are folded around the sums, as in the dot kernel (paged_attention_kernels): static keys
    # by scaling q per channel and adding q . zero, online keys by scaling q . c per key and adding zero * sum(q)
    if KV_MODE == 1:
        q_off = tl.sum(q * kz, 0)
        q = q * ks
    else:
        q_off = tl.sum(q, 0)

    per_split = tl.cdiv(tl.cdiv(cached, BLOCK_N), SPLITS) * BLOCK_N
    lo = tl.minimum(split * per_split, cached)
    hi = tl.minimum(lo + per_split, cached)
    full_end = lo + ((hi - lo) // BLOCK_N) * BLOCK_N

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
            rows, prows = _key_offsets(table_ptr, start, keys, key_ok, stride_cb, stride_ct, stride_pb, stride_pt,
                                       BLOCK_SIZE, BLOCK_N, phase == 1)
            ptrs = rows[:, None] + offs_d[None, :]
            if phase == 1:
                k = tl.load(k_ptr + ptrs, mask=key_ok[:, None], other=0)
                v = tl.load(v_ptr + ptrs, mask=key_ok[:, None], other=0)
            else:
                k = tl.load(k_ptr + ptrs)
                v = tl.load(v_ptr + ptrs)
            qk = tl.sum(k.to(tl.float32) * q[None, :], 1)
            if KV_MODE == 1:
                qk += q_off
            elif KV_MODE == 2:
                k_s, k_z = _token_params(kp_ptr, prows, key_ok, phase == 1)
                qk = qk * k_s + k_z * q_off
            if phase == 1:
                qk = tl.where(key_ok, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 0))  # finite: every tile holds at least one key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new)
            l_i = l_i * alpha + tl.sum(p, 0)
            if KV_MODE == 2:  # p . (c * s + z) = (p * s) . c + p . z
                v_s, v_z = _token_params(vp_ptr, prows, key_ok, phase == 1)
                acc = acc * alpha + tl.sum((p * v_s)[:, None] * v.to(tl.float32), 0) + tl.sum(p * v_z, 0)
            else:
                acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
            m_i = m_new
    if ROPE:  # noqa: SIM102 (constexpr first: without ROPE there is no k_new to compile the runtime branch with)
        if split == SPLITS - 1:  # the new key sits past every split's range; the last split takes it
            qk = tl.sum(k_new * q[None, :], 1)
            if KV_MODE == 1:
                qk += q_off
            elif KV_MODE == 2:
                qk = qk * k_new_s + k_new_z * q_off
            qk = tl.sum(qk, 0)
            m_new = tl.maximum(m_i, qk)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new)
            l_i = l_i * alpha + p
            acc = acc * alpha + tl.sum(p * (v_new * v_new_s[:, None] + v_new_z[:, None]), 0)
            m_i = m_new
    if KV_MODE == 1:  # sum_n p_n (c_n * s + z) = (sum_n p_n c_n) * s + l * z, per channel
        acc = acc * vs + l_i * vz

    if SPLITS == 1:
        out = acc / l_i
        tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))
    else:
        # an empty split (lo == ctx) writes max = -inf, sum = 0: the combine adds nothing from it
        slot = ((tile * num_heads + head) * SPLITS + split).to(tl.int64)
        tl.store(part_ptr + slot * HEAD_DIM + offs_d, acc)
        tl.store(part_ml_ptr + 2 * slot, m_i)
        tl.store(part_ml_ptr + 2 * slot + 1, l_i)
