"""Triton RoPE of the fused QKV projection, optionally writing the new keys and values into the paged KV cache.

    qkv [T, (Hq + 2 Hkv) D]  ->  q [T, Hq, D] rotated;  k [T, Hkv, D] rotated and v [T, Hkv, D]
                                 either returned or stored at their slots of the (float) cache

The PyTorch reference is `lmd.turbomind.rope.rotary_qkv_reference`, then `KVCache.write` (rotate_half over the
first `rot` columns, the rest passed through). The rotation is one fp32 FMA per element with a single rounding, so
it can differ from the reference's (which rounds x*cos and rotate_half(x)*sin separately) by one unit in the last
place. One program per (token, head): q heads, then k heads, then v heads (copied).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_qkv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, stride_qkv, stride_cs,
                       Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                       BLOCK_D: tl.constexpr, TO_SLOTS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    src = qkv_ptr + t * stride_qkv + head * D
    x = tl.load(src + d, mask=mask, other=0.0)
    if head < Q_HEADS + KV_HEADS:  # rotate q and k heads
        half: tl.constexpr = ROT // 2
        rot = d < ROT
        partner = tl.where(d < half, d + half, d - half)
        xp = tl.load(src + partner, mask=mask & rot, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * stride_cs + d, mask=mask & rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_cs + d, mask=mask & rot, other=0.0).to(tl.float32)
        sign = tl.where(d < half, -1.0, 1.0)
        x = tl.where(rot, x.to(tl.float32) * c + sign * xp * s, x.to(tl.float32)).to(q_ptr.dtype.element_ty)
    if head < Q_HEADS:
        tl.store(q_ptr + (t * Q_HEADS + head) * D + d, x, mask=mask)
    else:
        row = t
        if TO_SLOTS:
            row = tl.load(slot_ptr + t)
        if head < Q_HEADS + KV_HEADS:
            tl.store(k_ptr + (row * KV_HEADS + head - Q_HEADS) * D + d, x.to(k_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(v_ptr + (row * KV_HEADS + head - Q_HEADS - KV_HEADS) * D + d, x.to(v_ptr.dtype.element_ty),
                     mask=mask)


def rotary_qkv_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int,
                      head_dim: int, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                      slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) D] (columns contiguous), cos/sin [T, rot] -> (q, k, v), [T, heads, D] each.
    With k_cache/v_cache [slots, Hkv, D] (contiguous, float) and slots [T]: k and v go to those slots instead and
    the returned k, v are the caches."""
    t = qkv.shape[0]
    rot = cos.shape[-1]
    q = torch.empty((t, q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    to_slots = k_cache is not None
    if to_slots:
        assert v_cache is not None and slots is not None and k_cache.is_contiguous() and v_cache.is_contiguous()
        k, v = k_cache, v_cache
    else:
        k = torch.empty((t, kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
    if t:
        _rotary_qkv_kernel[(t, q_heads + 2 * kv_heads)](
            qkv, cos, sin, slots if to_slots else qkv, q, k, v, qkv.stride(0), cos.stride(0),
            Q_HEADS=q_heads, KV_HEADS=kv_heads, D=head_dim, ROT=rot, BLOCK_D=triton.next_power_of_2(head_dim),
            TO_SLOTS=to_slots, num_warps=1 if head_dim <= 128 else 2)
    return q, k, v
