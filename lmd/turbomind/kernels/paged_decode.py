"""The host side of the CUDA-core MHA decode kernel (`paged_decode_kernel`): its launch, which the paged-attention
dispatch (`paged_attention.paged_attention_triton`) calls for wide MHA decode launches, and `rope_decode_attention`,
RoPE, the KV write and the attention of a decode-only batch in that one launch (called by the engine's attention
layer in place of the rotary kernel and the dispatch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton

from lmd.turbomind.kernels.attention_config import (
    LOG2E,
    AttentionConfig,
    decode_splits,
    default_config,
    mha_rope_blocks,
    unsupported_reason,
)
from lmd.turbomind.kernels.paged_attention_kernels import _combine_kernel
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
    kv: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # KV_MODE, k_param, v_param, static
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # cos, sin, slots
) -> None:
    """The CUDA-core decode kernel (paged_decode_kernel) over meta's decode tiles; with rope, q is the fused
    projection and the kernel rotates it and stores the new keys and values first. kv (`kv_mode_args`; None: a
    float cache): an int8 cache's online params (KV_MODE 2: [blocks, block, H, 2] fp16 each) or static [4, H, D]
    fp32 table (KV_MODE 1); the tensors the mode does not read may be any."""
    cos, sin, slots = rope if rope is not None else (q, q, meta.seq_info)
    kv_mode, kp, vp, static = kv if kv is not None else (0, k, v, k)
    _decode_mha_kernel[(meta.decode_tiles.shape[0], k.shape[2], splits)](
        q,
        out,
        part,
        part_ml,
        k,
        v,
        kp,
        vp,
        static,
        meta.tables,
        meta.seq_info,
        meta.decode_tiles,
        cos,
        sin,
        slots,
        scale * LOG2E,
        cos.stride(0),
        *strides,
        *(kp.stride()[:3] if kv_mode == 2 else (0, 0, 0)),
        BLOCK_N=blocks[0],
        HEAD_DIM=k.shape[3],
        BLOCK_SIZE=k.shape[1],
        SPLITS=splits,
        KV_MODE=kv_mode,
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
    *,
    k_param: torch.Tensor | None = None,
    v_param: torch.Tensor | None = None,
    static: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """RoPE, the KV write and decode attention in one launch, for a batch of decodes only with one query head per KV
    head, wide enough for the CUDA-core kernel: qkv [T, 3 H D] (rows contiguous), cos/sin [T, rot], slots [T] int64
    (the new tokens' cache slots), k/v one layer's pools (float, or int8 codes with online k_param/v_param or a
    static table, as `paged_attention_triton` takes them) -> out [T, H, D], the new keys and values stored as
    `rotary_qkv_triton` / `KVCache.write` store them. None where the batch does not qualify: the caller runs the
    rotary kernel and `paged_attention_triton` (the same values, up to the order of one softmax sum)."""
    t = qkv.shape[0]
    if not (t and meta.num_tokens == t == meta.decode_tiles.shape[0] and not meta.prefill) or k.dim() != 4:
        return None
    d = k.shape[-1]
    if k.shape[2] != num_heads or qkv.shape[1] != 3 * num_heads * d or qkv.stride(1) != 1:
        return None
    q = qkv.view(t, 3 * num_heads, d)[:, :num_heads]
    rot = cos.shape[-1]
    kv = kv_mode_args(k, k_param, v_param, static)
    if kv is None or unsupported_reason(q, k.dtype if kv[0] == 0 else q.dtype) or k.dtype != v.dtype:
        return None
    if k.stride() != v.stride() or k.stride(3) != 1 or rot % 2 or rot > d or not cos.is_contiguous():
        return None
    if sin.stride() != cos.stride() or slots.shape != (t,):
        return None
    cfg = config or default_config(d, qkv.dtype)
    programs = t * num_heads
    blocks = mha_rope_blocks(programs, kv[0] != 0, cfg, qkv.device)
    if blocks is None:
        return None
    splits = decode_splits(programs, meta.max_decode_ctx, cfg, qkv.device)
    out = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    part, part_ml = split_partials(out, t, splits)
    strides = (qkv.stride(0), d, out.stride(0), out.stride(1), meta.tables.stride(0), *k.stride()[:3])
    launch_mha(qkv, out, part, part_ml, k, v, meta, scale, splits, blocks, strides, kv, (cos, sin, slots))
    combine_splits(part, part_ml, out, meta, splits)
    return out


def split_partials(out: torch.Tensor, tiles: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode launch's partial accumulators [tiles, heads, splits, D] and (max, sum) pairs [tiles, heads, splits,
    2] (fp32) for `out` [tokens, heads, D] over `tiles` decode tiles; an unsplit launch writes `out` itself (both
    returned as `out`)."""
    if splits == 1:
        return out, out
    _, heads, d = out.shape
    return (torch.empty((tiles, heads, splits, d), dtype=torch.float32, device=out.device),
            torch.empty((tiles, heads, splits, 2), dtype=torch.float32, device=out.device))


def combine_splits(part: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor, meta: AttentionMeta,
                   splits: int) -> None:
    """Merge a split decode launch's partials into out [tokens, heads, D] at meta's decode tiles (`_combine_kernel`);
    nothing if unsplit."""
    if splits == 1:
        return
    _, heads, d = out.shape
    grid = (meta.decode_tiles.shape[0], heads)
    _combine_kernel[grid](part, part_ml, out, meta.seq_info, meta.decode_tiles, heads, out.stride(0), out.stride(1),
                          SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=d, num_warps=1,
                          **pdl_options(out.device))


def kv_mode_args(k: torch.Tensor, k_param: torch.Tensor | None, v_param: torch.Tensor | None,
                 static: torch.Tensor | None) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`launch_mha`'s kv argument, (KV_MODE, k_param, v_param, static), for a cache k with these params, or None
    where they do not fit it: a float cache takes none; int8 codes take online params (fp16 [blocks, block, H, 2],
    equal strides, the pair contiguous) or a static table (contiguous fp32 [4, H, D])."""
    if k.dtype != torch.int8:
        return (0, k, k, k) if k_param is None and v_param is None and static is None else None
    if static is not None:
        ok = k_param is None and v_param is None and static.is_contiguous() and static.dtype == torch.float32
        return (1, k, k, static) if ok and static.shape == (4, *k.shape[2:]) else None
    if k_param is None or v_param is None or k_param.dtype != torch.float16 or v_param.dtype != torch.float16:
        return None
    ok = k_param.shape == v_param.shape == (*k.shape[:3], 2) and k_param.stride() == v_param.stride()
    return (2, k_param, v_param, k) if ok and k_param.stride(3) == 1 else None
