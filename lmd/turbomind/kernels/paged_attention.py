"""Paged attention on the Triton kernels (`paged_attention_kernels`, and `paged_decode` for wide MHA decodes):
checks and launches; per-batch metadata is in `attention_meta`, block configs and launch shapes in
`attention_config`.

`paged_attention_triton(q, k, v, meta, scale)` computes, for the flat batch that `meta` describes, exactly what
`lmd.turbomind.paged_attention.paged_attention_reference` computes on an engine cache (the oracle of the tests):
sequences with one new token run the decode kernel (split-K over the context, then a combine), longer chunks the
prefill kernel. It takes tensors only; the engine side (`lmd.turbomind.paged_attention`) unpacks its KVCache:

    q                 [T, Hq, D]                        fp16, bf16 or fp32: the new tokens, rotated (K/V stored)
    k, v              [num_blocks, block_size, Hkv, D]  one layer's block pools, in q's dtype or int8 codes
    k_param, v_param  [num_blocks, block_size, Hkv, 2]  online int8: fp16 (scale, zero) per token and head
    static            [4, Hkv, D]                       static int8: fp32 (k_scale, k_zero, v_scale, v_zero)
    meta              AttentionMeta                     from `attention_meta`: the batch's lengths and block tables

Int8 codes come with either k_param and v_param or static, and are dequantized to q's dtype. Sequence i owns rows
[q_starts[i], q_starts[i] + q_lens[i]) of q, at positions [ctx_lens[i] - q_lens[i], ctx_lens[i]) of its sequence,
whose K/V sit in the blocks block_tables[i]. One AttentionMeta serves every layer of a forward (the caller builds it
once per batch).
"""

from __future__ import annotations

import torch
import triton

from lmd.turbomind.kernels.attention_config import (
    LOG2E,
    AttentionConfig,
    decode_splits,
    default_config,
    mha_decode_blocks,
    unsupported_reason,
    wide_decode_launch,
)
from lmd.turbomind.kernels.attention_meta import AttentionMeta, attention_meta  # noqa: F401 (attention_meta: the API)
from lmd.turbomind.kernels.paged_attention_kernels import _attention_kernel
from lmd.turbomind.kernels.paged_decode import combine_splits, launch_mha, split_partials
from lmd.turbomind.kernels.pdl import pdl_options


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    k_param: torch.Tensor | None,
    v_param: torch.Tensor | None,
    static: torch.Tensor | None,
) -> int:
    """The KV_MODE of a call the kernels take (paged_attention_kernels: 0 float, 1 static int8, 2 online int8)."""
    int8 = k.dtype == torch.int8
    reason = unsupported_reason(q, q.dtype if int8 else k.dtype)
    if reason is not None:
        raise ValueError(f"paged_attention_triton: unsupported {reason}")
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} should be [blocks, block_size, Hkv, D] alike")
    if q.dim() != 3 or q.shape[0] != meta.num_tokens or q.shape[2] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} should be [{meta.num_tokens} tokens, heads, {k.shape[3]}]")
    if q.shape[1] % k.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[2]} KV heads")
    if q.stride(2) != 1 or k.stride() != v.stride() or k.stride(3) != 1:
        raise ValueError("q, k and v need a contiguous head dim, and k and v the same strides")
    if q.device != k.device:
        raise ValueError(f"q on {q.device} but the cache on {k.device}")
    if static is not None:
        if not int8 or k_param is not None or v_param is not None:
            raise ValueError("a static int8 table goes with int8 K/V codes and no online params")
        if static.shape != (4, *k.shape[2:]) or static.dtype != torch.float32 or not static.is_contiguous():
            raise ValueError(f"static int8 params {tuple(static.shape)} need a contiguous fp32 [4, Hkv, D] table")
        return 1
    if k_param is None or v_param is None:
        if int8 or k_param is not None or v_param is not None:
            raise ValueError("int8 K/V codes need k_param and v_param (online) or static; float K/V neither")
        return 0
    kp, vp = k_param, v_param
    layout = kp.shape == vp.shape == (*k.shape[:3], 2) and kp.stride() == vp.stride() and kp.stride(3) == 1
    if not (int8 and layout and kp.dtype == vp.dtype == torch.float16):
        raise ValueError("online int8 params need fp16 [blocks, block, Hkv, 2] with equal strides, beside int8 codes")
    return 2


def paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    *,
    k_param: torch.Tensor | None = None,
    v_param: torch.Tensor | None = None,
    static: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] over one layer's pools k, v (module docstring) -> out [T, Hq, D] in q's dtype."""
    kv_mode = _check(q, k, v, meta, k_param, v_param, static)
    cfg = config or default_config(q.shape[2], q.dtype)
    t, num_heads, d = q.shape
    out = torch.empty((t, num_heads, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    kv_heads = k.shape[2]
    group = num_heads // kv_heads
    g_pad = triton.next_power_of_2(group)
    # the kernel takes every pointer in every mode; the ones its KV_MODE does not read are k's
    kp, vp = (k_param, v_param) if kv_mode == 2 else (k, v)
    table = static if kv_mode == 1 else k
    strides = (
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        meta.tables.stride(0),
        *k.stride()[:3],
        *kp.stride()[:3],
    )
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    pdl = pdl_options(q.device)

    def launch(
        tiles: torch.Tensor,
        part: torch.Tensor,
        part_ml: torch.Tensor,
        g_rows: int,
        block_m: int,
        splits: int,
        blocks: tuple[int, int, int],  # block_n, warps, stages
    ) -> None:
        _attention_kernel[(tiles.shape[0], kv_heads, splits)](
            q,
            out,
            part,
            part_ml,
            k,
            v,
            kp,
            vp,
            table,
            meta.tables,
            meta.seq_info,
            tiles,
            scale * LOG2E,
            kv_heads,
            *strides,
            GROUP=group,
            G_ROWS=g_rows,
            BLOCK_M=block_m,
            BLOCK_N=blocks[0],
            HEAD_DIM=d,
            BLOCK_SIZE=k.shape[1],
            KV_MODE=kv_mode,
            SPLITS=splits,
            DOT_PRECISION=dot_precision,
            num_warps=blocks[1],
            num_stages=blocks[2],
            **pdl,
        )

    if meta.prefill:
        block_m = max(cfg.block_m, g_pad, 16)
        launch(meta.prefill_tiles(block_m // g_pad), out, out, g_pad, block_m, 1,
               (cfg.block_n, cfg.prefill_warps, cfg.num_stages))
    num_decode = meta.decode_tiles.shape[0]
    if not num_decode:
        return out
    programs = num_decode * kv_heads
    splits = decode_splits(programs, meta.max_decode_ctx, cfg, q.device)
    wide = wide_decode_launch(programs, kv_mode == 0, q.device)
    mha = mha_decode_blocks(programs, group, kv_mode != 0, cfg, q.device)
    part, part_ml = split_partials(out, num_decode, splits)
    if mha:
        launch_mha(q, out, part, part_ml, k, v, meta, scale, splits, mha, strides[:8], (kv_mode, kp, vp, table))
    else:
        rows = max(16, g_pad)
        blocks = (cfg.block_n, cfg.decode_warps, cfg.num_stages)
        if splits == 1 and cfg.wide_decode and wide:
            blocks = cfg.wide_decode
        launch(meta.decode_tiles, part, part_ml, rows, rows, splits, blocks)
    combine_splits(part, part_ml, out, meta, splits)
    return out

