"""Attention of a flat token batch over the paged KV cache.

`paged_attention` is the dispatch point. `paged_attention_reference` (gather each sequence's K/V from its blocks,
then SDPA with a causal offset) is the CPU path and the oracle of the kernels. The Triton kernels
(`kernels/paged_attention.py`, reading K/V straight from the blocks) run on CUDA tensors by default (LMD_ATTENTION
unset or `auto`), for the shapes they support; LMD_ATTENTION=reference forces the reference, LMD_ATTENTION=triton
also runs them on CPU tensors under TRITON_INTERPRET=1 (the tests). Checked on an H200 by
benchmarks/gpu_attention_tests.py and benchmarks/gpu_engine_check.py (docs/benchmarks.md).

The kernels take tensors; this module is their engine side. It hands them one layer's pools and int8 params of the
KVCache, builds the batch's metadata once per ForwardBatch (every layer of a forward passes the same object; a
decode graph's batch carries its static one in `attention_meta`) and the static int8 table once per layer of a
cache's static params. The kernel module is imported on first use (kernel_choice.triton_module), so the engine
imports, and runs on the reference, without Triton.
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lmd.errors import LmdError
from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.kernel_choice import triton_module, triton_requested
from lmd.turbomind.kv_cache import KVCache

if TYPE_CHECKING:
    from lmd.turbomind.kernels.paged_attention import AttentionConfig, AttentionMeta


def paged_attention(
    q: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch, scale: float, fused: bool = True
) -> torch.Tensor:
    """q [T, Hq, D] (new tokens, already rotated; their K/V already written) -> out [T, Hq, D].
    `fused` (config.ini use_context_fmha) picks SDPA / the Triton kernel; False runs the explicit softmax path.
    A shape or device the kernel does not take (e.g. head dim 80, CPU without the interpreter) runs the reference."""
    if triton_attention_runs(q, cache, fused):
        out = _run_kernels(_kernels(), q, cache, layer, batch, scale)
    else:
        out = paged_attention_reference(q, cache, layer, batch, scale, fused)
    if batch.tree is not None:  # token-tree chunks (speculative decoding): their rows again, with the tree mask
        from lmd.turbomind.tree_attention import with_tree_rows

        out = with_tree_rows(out, q, cache, layer, batch, scale)
    return out


def rope_decode_attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch,
    scale: float, num_heads: int, kv_heads: int, fused: bool = True
) -> torch.Tensor | None:
    """RoPE of the fused projection qkv [T, (Hq + 2 Hkv) D], the KV write and the attention in one Triton launch
    (kernels/paged_decode.rope_decode_attention): out [T, Hq, D], or None where the batch does not qualify (a
    prefill chunk, GQA, a token tree, the reference path, too few programs), and the caller rotates, writes and
    calls `paged_attention`. An int8 cache's new keys and values are quantized and stored by the launch too."""
    if num_heads != kv_heads or batch.tree is not None or qkv.dim() != 2 or not qkv.shape[0]:
        return None
    if batch.num_tokens != len(batch.q_lens):  # a chunk of more than one token: no views or metadata to build
        return None
    d = cache.k[layer].shape[-1]
    if not triton_attention_runs(qkv.view(qkv.shape[0], 3 * num_heads, d)[:, :num_heads], cache, fused):
        return None
    meta = _batch_meta(_kernels(), batch, qkv.device)
    return triton_module("paged_decode").rope_decode_attention(qkv, cos, sin, batch.slots, cache.k[layer],
                                                               cache.v[layer], meta, scale, num_heads,
                                                               **_int8_params(cache, layer))


def triton_attention_runs(q: torch.Tensor, cache: KVCache, fused: bool = True) -> bool:
    """Whether `paged_attention` takes the Triton kernels for queries like q (else the reference)."""
    if not (fused and _triton_requested(q)):
        return False
    kernels = _kernels()
    return kernels is not None and kernels.unsupported_reason(q, cache.dtype) is None


def paged_attention_triton_on_cache(
    q: torch.Tensor,
    cache: KVCache,
    layer: int,
    batch: ForwardBatch,
    scale: float,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """The Triton kernels on an engine cache whatever LMD_ATTENTION says (tests, GPU scripts); a call they do not
    take raises ValueError."""
    kernels = _kernels()
    if kernels is None:
        raise LmdError("paged attention: the Triton kernels need the triton package (pip install triton)")
    # int8 codes do not say which dtype they dequantize to (the kernels check a float cache's dtype themselves)
    reason = kernels.unsupported_reason(q, cache.dtype) if cache.int8 else None
    if reason is not None:
        raise ValueError(f"paged_attention_triton: unsupported {reason}")
    return _run_kernels(kernels, q, cache, layer, batch, scale, config)


def decode_graph_meta(
    seq_info: torch.Tensor, tables: torch.Tensor, max_context: int, tokens: int = 1
) -> AttentionMeta | None:
    """The kernels' metadata over a decode graph's static buffers (decode_graph.py): sequence i owns rows
    [i * tokens, (i + 1) * tokens) and computes seq_info[i, 1] <= tokens new tokens there. tokens = 1: the decode
    kernel, split for max_context. tokens > 1 (verifications): the prefill kernel, causal within the chunk; its tiles
    (sequence, first query token) depend on the bucket and `tokens` only, so they are built here, outside any
    capture, for every tile height the kernel can ask for (BLOCK_M // G_ROWS, a power of two; from `tokens` up one
    tile per sequence), and stay with the meta: keep it as long as a graph captured on it. A tile past a chunk's
    length stores nothing. None without Triton (the reference reads the batch's host tuples)."""
    kernels = _kernels()
    if kernels is None:
        return None
    b, device = seq_info.shape[0], seq_info.device
    if tokens == 1:
        rows = torch.arange(b, dtype=torch.int32, device=device)
        decode_tiles = torch.stack([rows, torch.zeros_like(rows)], dim=1).contiguous()
        return kernels.AttentionMeta(b, seq_info, decode_tiles, tables, max_context, [])
    none = torch.zeros((0, 2), dtype=torch.int32, device=device)
    meta = kernels.AttentionMeta(b * tokens, seq_info, none, tables, 0, [(i, tokens, tokens) for i in range(b)])
    height = 1
    while height < tokens:
        meta.prefill_tiles(height)
        height *= 2
    whole = meta.prefill_tiles(height)
    while height < _MAX_TILE_HEIGHT:
        height *= 2
        meta.tiles[height] = whole
    return meta


_MAX_TILE_HEIGHT = 1024  # query tokens per prefill tile: BLOCK_M // G_ROWS, far above any config's BLOCK_M


def _triton_requested(q: torch.Tensor) -> bool:
    return triton_requested(q, "LMD_ATTENTION")


def _kernels() -> ModuleType | None:
    return triton_module("paged_attention")


def _run_kernels(
    kernels: ModuleType,
    q: torch.Tensor,
    cache: KVCache,
    layer: int,
    batch: ForwardBatch,
    scale: float,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    meta = _batch_meta(kernels, batch, q.device)
    return kernels.paged_attention_triton(q, cache.k[layer], cache.v[layer], meta, scale, config=config,
                                          **_int8_params(cache, layer))


def _int8_params(cache: KVCache, layer: int) -> dict[str, torch.Tensor]:
    """The kernels' keyword arguments for one layer of an int8 cache (k_param and v_param, or static); none for a
    float cache."""
    if not cache.int8:
        return {}
    if cache.static is not None:
        return {"static": _static_table(cache, layer)}
    return {"k_param": cache.k_param[layer], "v_param": cache.v_param[layer]}


_last_batch: tuple[weakref.ref[ForwardBatch], AttentionMeta] | None = None


def _batch_meta(kernels: ModuleType, batch: ForwardBatch, device: torch.device) -> AttentionMeta:
    global _last_batch
    if isinstance(batch.attention_meta, kernels.AttentionMeta):  # static buffers of a decode graph
        return batch.attention_meta
    if _last_batch is not None and _last_batch[0]() is batch:
        return _last_batch[1]
    meta = kernels.attention_meta(batch.q_starts, batch.q_lens, batch.ctx_lens, batch.block_tables, device)
    _last_batch = (weakref.ref(batch), meta)
    return meta


_static_tables: dict[tuple[int, int], tuple[weakref.ref, torch.Tensor]] = {}


def _static_table(cache: KVCache, layer: int) -> torch.Tensor:
    """[4, Hkv, D] fp32 (k_scale, k_zero, v_scale, v_zero) of one layer, per-head params broadcast over D."""
    s = cache.static
    key = (id(s), layer)
    hit = _static_tables.get(key)
    if hit is not None and hit[0]() is s:
        return hit[1]
    for dead in [k for k, (ref, _) in _static_tables.items() if ref() is None]:
        del _static_tables[dead]
    _, _, kv_heads, head_dim = cache.k[layer].shape
    params = (s.k_scale[layer], s.k_zero[layer], s.v_scale[layer], s.v_zero[layer])
    table = torch.stack([p.float().reshape(kv_heads, -1).expand(kv_heads, head_dim) for p in params]).contiguous()
    _static_tables[key] = (weakref.ref(s), table)
    return table


def paged_attention_reference(
    q: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch, scale: float, fused: bool = True
) -> torch.Tensor:
    out = torch.empty_like(q)
    groups = q.shape[1] // cache.k[layer].shape[2]
    for start, n, ctx, table in zip(batch.q_starts, batch.q_lens, batch.ctx_lens, batch.block_tables, strict=True):
        k, v = cache.read(layer, table, ctx)  # [ctx, Hkv, D]
        qi = q[start : start + n].transpose(0, 1)  # [Hq, n, D]
        ki = k.transpose(0, 1).repeat_interleave(groups, dim=0)
        vi = v.transpose(0, 1).repeat_interleave(groups, dim=0)
        # query j sits at position ctx - n + j and sees keys 0 .. ctx - n + j
        mask = None if n == 1 else torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - n)
        if fused:
            o = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=mask, scale=scale)[0]
        else:
            scores = (qi.float() @ ki.float().transpose(1, 2)) * scale  # [Hq, n, ctx]
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            o = (scores.softmax(dim=-1) @ vi.float()).to(q.dtype)
        out[start : start + n] = o.transpose(0, 1)
    return out
