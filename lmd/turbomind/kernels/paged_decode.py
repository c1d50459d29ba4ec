"""The host side of the CUDA-core MHA decode kernel (`paged_decode_kernel`): its launch, which the paged-attention
dispatch (`paged_attention.paged_attention_triton`) calls for wide MHA decode launches, and `rope_decode_attention`,
RoPE, the KV write and the attention of a decode-only batch in that one launch (called by the engine's attention
layer in place of the rotary kernel and the dispatch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmd.turbomind.kernels.attention_config import (
    LOG2E,
    AttentionConfig,
    decode_splits,
    default_config,
    mha_decode_blocks,
    unsupported_reason,
)
from lmd.turbomind.kernels.paged_decode_kernel import _decode_mha_kernel
from lmd.turbomind.kernels.pdl import pdl_options

if TYPE_CHECKING:
    from lmd.turbomind.kernels.attention_meta import AttentionMeta


def launch_mha(
    q: torch.Tensor,
    out: torch.Tensor,
    part: torch.Tensor,
    part_ml: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    splits: int,
    blocks: tuple[int, int, int],
    strides: tuple[int, ...],  # q's token and head, out's token and head, the tables', k's block, token and head
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # cos, sin, slots
) -> None:
    """The CUDA-core decode kernel (paged_decode_kernel) over meta's decode tiles; with rope, q is the fused
    projection and the kernel rotates it and stores the new keys and values first."""
    cos, sin, slots = rope if rope is not None else (q, q, meta.seq_info)
    _decode_mha_kernel[(meta.decode_tiles.shape[0], k.shape[2], splits)](
        q,
        out,
        part,
        part_ml,
        k,
        v,
        meta.tables,
        meta.seq_info,
        meta.decode_tiles,
        cos,
        sin,
        slots,
        scale * LOG2E,
        cos.stride(0),
        *strides,
        BLOCK_N=blocks[0],
        HEAD_DIM=k.shape[3],
        BLOCK_SIZE=k.shape[1],
        SPLITS=splits,
        ROPE=rope is not None,
        ROT=cos.shape[-1] if rope is not None else 2,
        num_warps=blocks[1],
        num_stages=blocks[2],
        **pdl_options(q.device),
    )


def rope_decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    num_heads: int,
    config: AttentionConfig | None = None,
) -> torch.Tensor | None:
    """RoPE, the KV write and decode attention in one launch, for a batch of decodes only with one query head per KV
    head on a float cache, wide enough for the CUDA-core kernel: qkv [T, 3 H D] (rows contiguous), cos/sin [T, rot],
    slots [T] int64 (the new tokens' cache slots), k/v one layer's pools -> out [T, H, D], the new keys and values
    stored as `rotary_qkv_triton` stores them. None where the batch does not qualify: the caller runs the rotary
    kernel and `paged_attention_triton` (the same values, up to the order of one softmax sum)."""
    t = qkv.shape[0]
    if not (t and meta.num_tokens == t == meta.decode_tiles.shape[0] and not meta.prefill) or k.dim() != 4:
        return None
    d = k.shape[-1]
    if k.shape[2] != num_heads or qkv.shape[1] != 3 * num_heads * d or qkv.stride(1) != 1:
        return None
    q = qkv.view(t, 3 * num_heads, d)[:, :num_heads]
    rot = cos.shape[-1]
    if unsupported_reason(q, k.dtype) or k.dtype != v.dtype or k.stride() != v.stride() or k.stride(3) != 1:
        return None
    if rot % 2 or rot > d or not cos.is_contiguous() or sin.stride() != cos.stride() or slots.shape != (t,):
        return None
    cfg = config or default_config(d, qkv.dtype)
    programs = t * num_heads
    blocks = mha_decode_blocks(programs, 1, True, cfg, qkv.device)
    if blocks is None or decode_splits(programs, meta.max_decode_ctx, cfg, qkv.device) != 1:
        return None
    out = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    strides = (qkv.stride(0), d, out.stride(0), out.stride(1), meta.tables.stride(0), *k.stride()[:3])
    launch_mha(qkv, out, out, out, k, v, meta, scale, 1, blocks, strides, (cos, sin, slots))
    return out
