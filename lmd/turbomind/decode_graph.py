"""CUDA graphs of the decode step: every sequence of the batch adds one token.

A decode step of a small model is mostly kernel launches from Python; replaying a captured graph removes them. One
graph per batch-size bucket (1, 2, 4, 8, 16, 24, ... up to max_batch_size); a batch runs in the smallest bucket that
holds it, the rows past its size padded. Everything a step reads lives in static device buffers that the graph was
captured on, refilled before each replay:

    input_ids, positions, slots, seq_lens   [B]          int64
    seq_info                                [B, 3]       int32   (row, 1, context length): the attention's metadata
    tables                                  [B, blocks]  int32   block tables, zero-padded
    decode_tiles                            [B, 2]       int32   (row, 0), fixed

Padding rows write their K/V into a scratch block the block manager never hands out (the runner allocates one block
more than it reports) and attend to that one key; their logits are dropped. The attention kernels split each
sequence's context by its own length at run time, so one capture with the split count of the longest context serves
every length.

Without capture (`capture=False`: the CPU tests) the same buffers run the model eagerly, so the padding, the
scratch block and the metadata are checked where no GPU is.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from lmd.turbomind.forward_batch import ForwardBatch, patch_inflight
from lmd.turbomind.kernels.host_copy import to_device
from lmd.turbomind.kv_cache import KVCache
from lmd.turbomind.model import LlamaModel
from lmd.turbomind.paged_attention import decode_graph_meta


def _zeros(count: int) -> array:
    return array("i", bytes(4 * count))


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below max_batch, then max_batch itself (vLLM's capture sizes): a batch pads
    by at most 7 rows, not up to twice its size."""
    out = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return [*out, max_batch]


class DecodeGraphs:
    def __init__(self, model: LlamaModel, cache: KVCache, scratch_block: int, max_batch: int, max_context: int,
                 device: torch.device, capture: bool) -> None:
        self.model, self.cache, self.device, self.capture = model, cache, device, capture
        self.block_size = cache.block_size
        self.scratch_slot = scratch_block * self.block_size
        self.max_context = max_context
        self.buckets = batch_buckets(max_batch)
        b, blocks = self.buckets[-1], -(-max_context // self.block_size)
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slots = torch.full((b,), self.scratch_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int64, device=device)
        rows = torch.arange(b, dtype=torch.int32, device=device)
        self.seq_info = torch.stack([rows, torch.ones_like(rows), torch.ones_like(rows)], dim=1).contiguous()
        self.decode_tiles = torch.stack([rows, torch.zeros_like(rows)], dim=1).contiguous()
        self.tables = torch.full((b, blocks), scratch_block, dtype=torch.int32, device=device)
        self.logit_rows = torch.arange(b, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, chunks: Sequence[tuple[list[int], int, list[int]]]) -> bool:
        """Decode-only, within the largest bucket and the captured context length."""
        return (0 < len(chunks) <= self.buckets[-1]
                and all(len(ids) == 1 and start < self.max_context for ids, start, _ in chunks))

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def run(self, chunks: Sequence[tuple[list[int], int, list[int]]],
            inflight: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """fp32 logits [len(chunks), vocab] of one decode step (chunks: (one token id, start, block table));
        `inflight`: (InflightIds.sources pairs, ids on the device) for the chunks whose id is INFLIGHT (overlap)."""
        n, b = len(chunks), self.bucket(len(chunks))
        self._fill(chunks, b)
        if inflight is not None:
            patch_inflight(self.input_ids, *inflight)
        if not self.capture:
            return self.model.forward(self._batch(b, [start + 1 for _, start, _ in chunks]), self.cache)[:n]
        graph, logits = self.graphs[b]  # every bucket was captured at start (capture_all)
        graph.replay()
        return logits[:n].clone()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket now (largest first: the smaller graphs reuse its memory pool)."""
        if self.capture:
            for b in reversed(self.buckets):
                self._fill([], b)
                self.graphs[b] = self._capture(b)

    def _fill(self, chunks: Sequence[tuple[list[int], int, list[int]]], b: int) -> None:
        n, bs = len(chunks), self.block_size
        lens = [start + 1 for _, start, _ in chunks]
        blocks = [-(-length // bs) for length in lens]
        # only the block-table columns some row uses are written: the kernels never read a row past its length, so
        # older entries further right are never looked at (and are valid block ids anyway)
        width = max(blocks, default=1)
        flat = array("i")
        ids, positions, slots = [], [], []
        for (token_ids, start, table), used in zip(chunks, blocks, strict=True):
            ids.append(token_ids[0])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            flat.extend(table[:used])
            flat.extend(_zeros(width - used))
        pad = b - n  # rows n .. b-1: the scratch slot, one key
        scratch = self.scratch_slot // bs
        for _ in range(pad):
            flat.append(scratch)
            flat.extend(_zeros(width - 1))
        host = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [self.scratch_slot] * pad,
                             lens + [1] * pad], dtype=torch.int64)
        staged = to_device(host, torch.int64, self.device)  # pinned: queued, never waiting for the GPU
        self.input_ids[:b].copy_(staged[0])
        self.positions[:b].copy_(staged[1])
        self.slots[:b].copy_(staged[2])
        self.seq_lens[:b].copy_(staged[3])
        self.seq_info[:b, 2].copy_(staged[3])
        self.tables[:b, :width].copy_(to_device(torch.frombuffer(flat, dtype=torch.int32).view(b, width), torch.int32,
                                                self.device))

    def _batch(self, b: int, ctx_lens: list[int]) -> ForwardBatch:
        """The static buffers' first b rows as a ForwardBatch. The host tuples describe the same rows for the
        reference attention (eager runs); the Triton attention reads `attention_meta` instead."""
        ctx = ctx_lens + [1] * (b - len(ctx_lens))
        tables = tuple(self.tables[i, : -(-c // self.block_size)].long() for i, c in enumerate(ctx))
        meta = decode_graph_meta(self.seq_info[:b], self.decode_tiles[:b], self.tables[:b], self.max_context)
        return ForwardBatch(self.input_ids[:b], self.positions[:b], self.slots[:b], self.seq_lens[:b],
                            tuple(range(b)), (1,) * b, tuple(ctx), tables, self.logit_rows[:b], meta)

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self._batch(b, [1] * b)  # the host tuples are not read by the captured (Triton) path
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.model.forward(batch, self.cache)  # warm-up: compiles kernels, tunes W4A16 plans, grows workspaces
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values()))[0].pool() if self.graphs else None
        with torch.cuda.graph(graph, pool=pool):
            logits = self.model.forward(batch, self.cache)
        return graph, logits
