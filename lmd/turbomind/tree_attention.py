"""Tree attention (speculative token trees): the dispatch point and its PyTorch reference.

Like paged attention over a flat batch (`forward_batch.ForwardBatch`), except that row j of a sequence's chunk of n
new tokens sees every cached key before the chunk and the chunk's key i iff bit i of `row_masks[row]` is set (the
tree's ancestors and itself: `speculative/tree.TokenTree.row_masks`); a chain's masks (2^(j+1) - 1) give the causal
chunk. The K/V of the chunk are already stored at the sequence's positions [ctx - n, ctx), the tree flattened.

`tree_attention` runs the Triton kernel (`kernels/tree_attention.py`) where paged attention would run its kernels
(LMD_ATTENTION: CUDA tensors by default, CPU tensors with `triton` under TRITON_INTERPRET=1) on a float cache, and
this reference otherwise (CPU, int8 KV, `reference`, shapes the kernel does not take).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.kernel_choice import triton_module, triton_requested
from lmd.turbomind.kernels.host_copy import to_device
from lmd.turbomind.kv_cache import KVCache


@dataclass(frozen=True)
class TreeRows:
    """The chunks of a batch that are token trees (`ForwardBatch.tree`): their rows of the flat batch, and a
    sub-batch of those sequences alone (their rows renumbered from 0) with each row's mask."""

    index: torch.Tensor  # [R] int64: the rows, on the device
    masks: torch.Tensor  # [R] int64
    q_starts: tuple[int, ...]
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    block_tables: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, batch: ForwardBatch, trees: dict[int, list[int]]) -> TreeRows:
        """trees: batch sequence index -> the row masks of its chunk (as long as the chunk)."""
        rows, masks, starts = [], [], []
        for i, chunk_masks in sorted(trees.items()):
            starts.append(len(rows))
            rows += range(batch.q_starts[i], batch.q_starts[i] + batch.q_lens[i])
            masks += chunk_masks
        seqs = sorted(trees)
        device = batch.input_ids.device
        return cls(to_device(rows, torch.int64, device), to_device(masks, torch.int64, device), tuple(starts),
                   tuple(batch.q_lens[i] for i in seqs), tuple(batch.ctx_lens[i] for i in seqs),
                   tuple(batch.block_tables[i] for i in seqs))


def with_tree_rows(out: torch.Tensor, q: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch,
                   scale: float) -> torch.Tensor:
    """`out` of the causal attention with the rows of the batch's tree chunks replaced by their tree attention."""
    tree: TreeRows = batch.tree  # type: ignore[assignment]
    sub = dataclasses.replace(batch, q_starts=tree.q_starts, q_lens=tree.q_lens, ctx_lens=tree.ctx_lens,
                              block_tables=tree.block_tables, attention_meta=None, tree=None)
    out[tree.index] = tree_attention(q[tree.index], cache, layer, sub, tree.masks, scale)
    return out


def tree_attention(q: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch, row_masks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]; row_masks [T] int64 (on q's device)."""
    kernels = triton_module("tree_attention") if triton_requested(q, "LMD_ATTENTION") and not cache.int8 else None
    if kernels is not None and kernels.unsupported_reason(q, cache.dtype) is None \
            and max(batch.q_lens, default=0) <= kernels.MAX_TREE_ROWS:
        meta = kernels.attention_meta(batch.q_starts, batch.q_lens, batch.ctx_lens, batch.block_tables, q.device)
        return kernels.tree_attention_triton(q, cache.k[layer], cache.v[layer], meta, row_masks,
                                             list(batch.q_lens), scale)
    return tree_attention_reference(q, cache, layer, batch, row_masks, scale)


def tree_attention_reference(q: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch,
                             row_masks: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    groups = q.shape[1] // cache.k[layer].shape[2]
    masks = row_masks.cpu()
    for start, n, ctx, table in zip(batch.q_starts, batch.q_lens, batch.ctx_lens, batch.block_tables, strict=True):
        k, v = cache.read(layer, table, ctx)  # [ctx, Hkv, D]
        bits = masks[start:start + n, None] >> torch.arange(n)[None, :] & 1  # [n rows, n chunk keys]
        visible = torch.cat([torch.ones(n, ctx - n, dtype=torch.bool), bits.bool()], dim=1).to(q.device)
        qi = q[start:start + n].transpose(0, 1).float()  # [Hq, n, D]
        ki = k.transpose(0, 1).repeat_interleave(groups, dim=0).float()
        vi = v.transpose(0, 1).repeat_interleave(groups, dim=0).float()
        o = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=visible, scale=scale)[0]
        out[start:start + n] = o.transpose(0, 1).to(q.dtype)
    return out
