"""Attention of a flat token batch over the paged KV cache.

`paged_attention` is the dispatch point: a Triton kernel in `kernels/paged_attention.py` (when present) runs on CUDA;
`paged_attention_reference` (gather each sequence's K/V from its blocks, then SDPA with a causal offset) runs
everywhere else and is the oracle of any kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.kv_cache import KVCache


def paged_attention(q: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch, scale: float,
                    fused: bool = True) -> torch.Tensor:
    """q [T, Hq, D] (new tokens, already rotated; their K/V already written) -> out [T, Hq, D].
    `fused` (config.ini use_context_fmha) picks SDPA / the Triton kernel; False runs the explicit softmax path."""
    if q.is_cuda and fused:
        kernel = _triton_kernel()
        if kernel is not None:
            return kernel(q, cache, layer, batch, scale)
    return paged_attention_reference(q, cache, layer, batch, scale, fused)


@functools.cache
def _triton_kernel() -> Callable[..., torch.Tensor] | None:
    try:
        from lmd.turbomind.kernels.paged_attention import paged_attention_triton
    except ImportError:
        return None
    return paged_attention_triton


def paged_attention_reference(q: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch, scale: float,
                              fused: bool = True) -> torch.Tensor:
    out = torch.empty_like(q)
    groups = q.shape[1] // cache.k[layer].shape[2]
    for start, n, ctx, table in zip(batch.q_starts, batch.q_lens, batch.ctx_lens, batch.block_tables, strict=True):
        k, v = cache.read(layer, table, ctx)  # [ctx, Hkv, D]
        qi = q[start:start + n].transpose(0, 1)  # [Hq, n, D]
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
        out[start:start + n] = o.transpose(0, 1)
    return out
