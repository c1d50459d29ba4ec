"""Attention of a flat token batch over the paged KV cache.

`paged_attention` is the dispatch point. `paged_attention_reference` (gather each sequence's K/V from its blocks,
then SDPA with a causal offset) is the CPU path and the oracle of the kernels. The Triton kernels
(`kernels/paged_attention.py`, reading K/V straight from the blocks) run on CUDA tensors by default (LMD_ATTENTION
unset or `auto`), for the shapes they support; LMD_ATTENTION=reference forces the reference, LMD_ATTENTION=triton
also runs them on CPU tensors under TRITON_INTERPRET=1 (the tests). Checked on an H200 by
benchmarks/gpu_attention_tests.py and benchmarks/gpu_engine_check.py (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.kernel_choice import triton_module, triton_requested
from lmd.turbomind.kv_cache import KVCache


def paged_attention(
    q: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch, scale: float, fused: bool = True
) -> torch.Tensor:
    """q [T, Hq, D] (new tokens, already rotated; their K/V already written) -> out [T, Hq, D].
    `fused` (config.ini use_context_fmha) picks SDPA / the Triton kernel; False runs the explicit softmax path.
    A shape or device the kernel does not take (e.g. head dim 80, CPU without the interpreter) runs the reference."""
    if triton_attention_runs(q, cache, fused):
        return _triton_kernel()[0](q, cache, layer, batch, scale)
    return paged_attention_reference(q, cache, layer, batch, scale, fused)


def triton_attention_runs(q: torch.Tensor, cache: KVCache, fused: bool = True) -> bool:
    """Whether `paged_attention` takes the Triton kernels for queries like q (else the reference)."""
    if not (fused and _triton_requested(q)):
        return False
    kernel = _triton_kernel()
    return kernel is not None and kernel[1](q, cache) is None


def _triton_requested(q: torch.Tensor) -> bool:
    return triton_requested(q, "LMD_ATTENTION")


@functools.cache
def _triton_kernel() -> tuple[Callable[..., torch.Tensor], Callable[..., str | None]] | None:
    module = triton_module("paged_attention")
    return None if module is None else (module.paged_attention_triton, module.unsupported_reason)


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
