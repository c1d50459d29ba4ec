"""Triton RoPE of the fused QKV projection, optionally writing the new keys and values into the paged KV cache.

    qkv [T, (Hq + 2 Hkv) D]  ->  q [T, Hq, D] rotated;  k [T, Hkv, D] rotated and v [T, Hkv, D]
                                 either returned or stored at their slots of the cache: float, or online int8
                                 (codes, and the fp16 (scale, zero) of each token and head beside them)

The PyTorch reference is `lmd.turbomind.rope.rotary_qkv_reference`, then `KVCache.write` (rotate_half over the
first `rot` columns, the rest passed through). The rotation is one fp32 FMA per element with a single rounding, so
it can differ from the reference's (which rounds x*cos and rotate_half(x)*sin separately) by one unit in the last
place. One program per (token, group of heads): q heads, then k heads, then v heads (copied).

Online int8 follows `kv_int8.online_params` and `kv_int8.quantize` operation for operation (fp32, IEEE division,
fp16-rounded parameters, round half to even), so the codes and parameters equal `KVCache.write`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.pdl import pdl_options, pdl_prologue


@triton.jit
def _round_half_even(y):
    r = tl.floor(y + 0.5)
    return tl.where((r - y == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)


@triton.jit
def int8_codes(xf, scale, zero):
    """`kv_int8.quantize` in fp32: round half to even of (x - zero) / scale (IEEE division), clamped to int8."""
    codes = _round_half_even(tl.math.div_rn(xf - zero, scale))
    return tl.minimum(tl.maximum(codes, -128.0), 127.0).to(tl.int8)


@triton.jit
def online_int8(xf, mask):
    """`kv_int8.online_params` then `quantize` of rows xf [R, BLOCK_D] fp32 whose real columns are `mask`: codes
    [R, BLOCK_D] int8 and each row's scale, zero [R] (fp32 holding their fp16 values, as stored)."""
    hi = tl.max(tl.where(mask, xf, float("-inf")), axis=1)
    lo = tl.min(tl.where(mask, xf, float("inf")), axis=1)
    zero = ((hi + lo) / 2.0).to(tl.float16).to(tl.float32)
    reach = tl.maximum(hi - zero, zero - lo)
    scale = (tl.maximum(tl.math.div_rn(reach, 127.5), 6.2e-5) * (1 + 2.0 ** -10)).to(tl.float16).to(tl.float32)
    return int8_codes(xf, scale[:, None], zero[:, None]), scale, zero


@triton.jit
def _rotary_qkv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, kp_ptr, vp_ptr, stride_qkv,
                       stride_cs, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, TO_SLOTS: tl.constexpr, INT8: tl.constexpr,
                       USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * BLOCK_H  # BLOCK_H divides Q_HEADS and KV_HEADS: a program's heads are all q, k or v
    heads = head0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (d < D)[None, :]
    rows = qkv_ptr + t * stride_qkv + heads[:, None] * D
    x = tl.load(rows + d[None, :], mask=mask, other=0.0)
    if head0 < Q_HEADS + KV_HEADS:  # rotate q and k heads
        half: tl.constexpr = ROT // 2
        rot = d < ROT
        partner = tl.where(d < half, d + half, d - half)
        xp = tl.load(rows + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * stride_cs + d, mask=(d < D) & rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_cs + d, mask=(d < D) & rot, other=0.0).to(tl.float32)
        sign = tl.where(d < half, -1.0, 1.0)
        x = tl.where(rot[None, :], x.to(tl.float32) * c[None, :] + (sign * s)[None, :] * xp, x.to(tl.float32))
        x = x.to(q_ptr.dtype.element_ty)
    if head0 < Q_HEADS:
        tl.store(q_ptr + (t * Q_HEADS + heads[:, None]) * D + d[None, :], x, mask=mask)
    else:
        row = t
        if TO_SLOTS:
            row = tl.load(slot_ptr + t)
        is_k = head0 < Q_HEADS + KV_HEADS
        kv_heads = tl.where(is_k, heads - Q_HEADS, heads - Q_HEADS - KV_HEADS)
        dst = (row * KV_HEADS + kv_heads[:, None]) * D + d[None, :]
        if INT8:
            codes, scale, zero = online_int8(x.to(tl.float32), mask)
            p = (row * KV_HEADS + kv_heads) * 2
            if is_k:
                tl.store(k_ptr + dst, codes, mask=mask)
                tl.store(kp_ptr + p, scale.to(tl.float16))
                tl.store(kp_ptr + p + 1, zero.to(tl.float16))
            else:
                tl.store(v_ptr + dst, codes, mask=mask)
                tl.store(vp_ptr + p, scale.to(tl.float16))
                tl.store(vp_ptr + p + 1, zero.to(tl.float16))
        elif is_k:
            tl.store(k_ptr + dst, x.to(k_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(v_ptr + dst, x.to(v_ptr.dtype.element_ty), mask=mask)


def heads_per_program(q_heads: int, kv_heads: int, cap: int = 8) -> int:
    """The largest power of two up to `cap` dividing both head counts: a program then never mixes q, k and v heads.
    One head per program left the decode step's rotary at ~6,000 one-warp programs for 64 tokens, 8.4 µs a layer on
    the H200 (docs/benchmarks.md, seventeenth session)."""
    h = 1
    while h < cap and q_heads % (2 * h) == 0 and kv_heads % (2 * h) == 0:
        h *= 2
    return h


def rotary_qkv_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int,
                      head_dim: int, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                      slots: torch.Tensor | None = None, k_param: torch.Tensor | None = None,
                      v_param: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) D] (columns contiguous), cos/sin [T, rot] -> (q, k, v), [T, heads, D] each.
    With k_cache/v_cache [slots, Hkv, D] (contiguous, float or int8 codes) and slots [T]: k and v go to those slots
    instead and the returned k, v are the caches; int8 codes need k_param/v_param [slots, Hkv, 2] fp16 (online
    int8: scale, zero of each token and head)."""
    t = qkv.shape[0]
    rot = cos.shape[-1]
    q = torch.empty((t, q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    to_slots = k_cache is not None
    int8 = to_slots and k_cache.dtype == torch.int8  # type: ignore[union-attr]
    if to_slots:
        assert v_cache is not None and slots is not None and k_cache.is_contiguous() and v_cache.is_contiguous()
        k, v = k_cache, v_cache
    else:
        k = torch.empty((t, kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
    if int8:
        assert k_param is not None and v_param is not None and k_param.is_contiguous() and v_param.is_contiguous()
        assert k_param.dtype == v_param.dtype == torch.float16 and k_param.shape[-1] == 2
    if t:
        block_h = heads_per_program(q_heads, kv_heads)
        block_d = triton.next_power_of_2(head_dim)
        _rotary_qkv_kernel[(t, (q_heads + 2 * kv_heads) // block_h)](
            qkv, cos, sin, slots if to_slots else qkv, q, k, v, k_param if int8 else q, v_param if int8 else q,
            qkv.stride(0), cos.stride(0), Q_HEADS=q_heads, KV_HEADS=kv_heads, D=head_dim, ROT=rot,
            BLOCK_D=block_d, BLOCK_H=block_h, TO_SLOTS=to_slots, INT8=int8,
            num_warps=max(1, min(4, block_h * block_d // 256)), **pdl_options(qkv.device))
    return q, k, v
