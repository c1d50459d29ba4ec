"""A target forward whose batch holds token-tree chunks, and the KV of the path kept.

The forward is the runner's eager path (`ModelRunner.run(..., adjust=...)`: a verification step never replays a
decode graph, and speculation runs at tp = pp = 1) with two changes for each tree chunk (the root, then the nodes
parents first): its nodes' positions are the root's plus their depth (RoPE), and its rows attend through the tree
mask (`ForwardBatch.tree`). Their K/V land
in the sequence's slots in chunk order, so after the verification the kept path's K/V are moved down to the
positions the path now has (node k of the path from root position + 1 + its node index to root position + 1 + k);
the slots past them hold only rejected nodes and are dropped with the blocks past the sequence (`BlockManager.trim`)
or overwritten later.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from lmd.turbomind.forward_batch import ForwardBatch, InflightIds
from lmd.turbomind.kernels.host_copy import to_device
from lmd.turbomind.tree_attention import TreeRows

if TYPE_CHECKING:
    from lmd.turbomind.kv_cache import KVCache
    from lmd.turbomind.model_runner import ModelRunner
    from lmd.turbomind.scheduler import SchedulerOutput
    from lmd.turbomind.speculative.tree import TokenTree


def run_with_trees(runner: ModelRunner, output: SchedulerOutput, trees: dict[int, TokenTree],
                   inflight: InflightIds | None) -> torch.Tensor:
    """fp32 logits in chunk order, as `ModelRunner.run` returns them; trees: seq_id -> the tree of its chunk."""
    masks: dict[int, list[int]] = {}
    moved: list[tuple[int, int]] = []  # (flat row, position) of tree nodes
    end = 0
    for b, chunk in enumerate(output.chunks):
        tree = trees.get(chunk.seq_id) if chunk.num_draft else None
        if tree is not None:  # proposals go to decoding sequences only: the chunk is the root and the nodes
            masks[b] = tree.row_masks()
            moved += [(end + 1 + i, chunk.start + d) for i, d in enumerate(tree.depths)]
        end += len(chunk.token_ids)

    def adjust(batch: ForwardBatch) -> ForwardBatch:
        positions = batch.positions.clone()
        positions[to_device([r for r, _ in moved], torch.int64, runner.device)] = \
            to_device([p for _, p in moved], torch.int64, runner.device)
        return dataclasses.replace(batch, positions=positions, tree=TreeRows.of(batch, masks))

    return runner.run(output, inflight, adjust=adjust)


def move_kept_kv(cache: KVCache, block_table: list[int], root_position: int, kept: list[int]) -> None:
    """The kept path's K/V (and int8 params) to the positions after the root, in every layer."""
    pairs = [(root_position + 1 + node, root_position + 1 + k) for k, node in enumerate(kept) if node != k]
    if not pairs:
        return
    bs = cache.block_size

    def slot(position: int) -> int:
        return block_table[position // bs] * bs + position % bs

    device = cache.k[0].device
    src = to_device([slot(s) for s, _ in pairs], torch.int64, device)
    dst = to_device([slot(d) for _, d in pairs], torch.int64, device)
    for pools in (cache.k, cache.v, cache.k_param, cache.v_param):
        for pool in pools:
            flat = pool.view(-1, *pool.shape[2:])
            flat.index_copy_(0, dst, flat.index_select(0, src))
