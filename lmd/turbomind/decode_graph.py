"""CUDA graphs of steps in which every sequence computes at most T tokens: decode steps (T = 1) and, with a
speculative chain, verification steps (T = 1 + K: the last sampled token and K proposals, logits at every position).

A step of a small model is mostly kernel launches from Python; replaying a captured graph removes them. One
`DecodeGraphs` per T, one graph per batch-size bucket (1, 2, 4, 8, 16, 24, ... up to max_batch_size); a batch runs in
the smallest bucket that holds it. Sequence i of the bucket owns rows [i * T, (i + 1) * T) of the flat batch and
computes its n_i <= T tokens in the first n_i of them, so one graph serves every step whose chunks are at most T
long: a verification of fewer proposals (a request's adaptive k, a short n-gram match), a plain decode beside
verifications (the mixed step), a short prompt chunk. Everything a step reads lives in static device buffers that
the graph was captured on, refilled before each replay:

    input_ids, positions, slots, seq_lens   [B * T]      int64
    seq_info                                [B, 3]       int32   (i * T, n_i, context length): the attention's metadata
    tables                                  [B, blocks]  int32   block tables, zero-padded
    + the attention's tiles, fixed per bucket (`paged_attention.decode_graph_meta`)

Padding (the rows past a chunk's n_i, and every row of the sequences past the batch) writes its K/V into a scratch
block the block manager never hands out (the runner allocates one block more than it reports); a padding sequence
attends to that one key, and the attention stores nothing for a padding row of a real sequence; their logits are
dropped. The attention kernels read each sequence's lengths from seq_info at run time (T = 1: the decode kernel,
split for the longest context; T > 1: the prefill kernel, causal within the chunk), so one capture serves every
length. Each graph computes logits of all B * T rows; the step's wanted rows are gathered after the replay.

Verification graphs (`ModelRunner.enable_verify_graphs`, captured for a speculative chain's K by
`Speculator.prepare`; token trees run eagerly) add one capture per bucket at start and keep each graph's logits,
bucket x T x vocab fp32; their activations share the decode graphs' pool. A mixed step pays T rows for each plain
sequence in it: on a GPU a few rows more cost far less than the launches of an eager step.

Without capture (`capture=False`: the CPU tests) the same buffers run the model eagerly, so the padding, the
scratch block and the metadata are checked where no GPU is.

With tensor parallelism every rank captures its own graphs, NCCL's all-reduces inside, bucket by bucket in the same
order; a worker rank's graphs stop at the final norm (`logits=False`: rank 0 alone needs the logits). The warm-up
forward before each capture runs the collectives for real, so the ranks go in step; the capture itself runs none, and
`agree` lets the ranks decide together after each bucket whether every capture succeeded, so that a failure stops all
of them at the same bucket (`CaptureFailed`) rather than leaving one rank at a collective the others never reach.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

import torch

from lmd.turbomind.forward_batch import ForwardBatch, patch_inflight
from lmd.turbomind.kernels.host_copy import to_device
from lmd.turbomind.kv_cache import KVCache
from lmd.turbomind.model import LlamaModel
from lmd.turbomind.paged_attention import decode_graph_meta

Chunk = tuple[list[int], int, list[int]]  # (token ids of this step, start position, block table)


class CaptureFailed(RuntimeError):
    """A rank's capture of a bucket failed (here or on another rank: `DecodeGraphs.capture_all`'s `agree`)."""


def _zeros(count: int) -> array:
    return array("i", bytes(4 * count))


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below max_batch, then max_batch itself (vLLM's capture sizes): a batch pads
    by at most 7 rows, not up to twice its size."""
    out = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return [*out, max_batch]


class DecodeGraphs:
    def __init__(self, model: LlamaModel, cache: KVCache, scratch_block: int, max_batch: int, max_context: int,
                 device: torch.device, capture: bool, tokens: int = 1, pool: tuple | None = None,
                 logits: bool = True) -> None:
        """`tokens`: T, the most tokens a sequence computes per step; `pool`: another DecodeGraphs' memory pool
        (`pool()`) to capture into, so graphs of different T share their activation memory; `logits`: False on a
        tensor-parallel worker rank (the layers and the final norm only: `run` returns nothing)."""
        self.model, self.cache, self.device, self.capture = model, cache, device, capture
        self.tokens, self.logits = tokens, logits
        self.block_size = cache.block_size
        self.scratch_slot = scratch_block * self.block_size
        self.max_context = max_context
        self.buckets = batch_buckets(max_batch)
        b, blocks = self.buckets[-1], -(-max_context // self.block_size)
        rows = b * tokens
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.full((rows,), self.scratch_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int64, device=device)
        first = torch.arange(0, rows, tokens, dtype=torch.int32, device=device)
        self.seq_info = torch.stack([first, torch.ones_like(first), torch.ones_like(first)], dim=1).contiguous()
        self.tables = torch.full((b, blocks), scratch_block, dtype=torch.int32, device=device)
        self.logit_rows = torch.arange(rows, dtype=torch.int64, device=device)
        self.metas = {n: decode_graph_meta(self.seq_info[:n], self.tables[:n], max_context, tokens)
                      for n in self.buckets}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = pool

    def fits(self, chunks: Sequence[Chunk]) -> bool:
        """At most T tokens per chunk, within the largest bucket and the captured context length."""
        return (0 < len(chunks) <= self.buckets[-1]
                and all(0 < len(ids) <= self.tokens and start + len(ids) <= self.max_context
                        for ids, start, _ in chunks))

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def pool(self) -> tuple | None:
        """The memory pool these graphs were captured into (None before any capture)."""
        return next(iter(self.graphs.values()))[0].pool() if self.graphs else self._pool

    @torch.inference_mode()
    def run(self, chunks: Sequence[Chunk], inflight: tuple[list[int], torch.Tensor] | None = None,
            rows: Sequence[int] | None = None) -> torch.Tensor:
        """fp32 logits of `rows` (positions in the flat, unpadded batch of `chunks`; None: every chunk's last token)
        of one step. `inflight`: (InflightIds.sources pairs, in the same flat positions; ids on the device) for the
        chunks whose id is INFLIGHT (overlap)."""
        b = self.bucket(len(chunks))
        padded, q_lens, ctx_lens = self._fill(chunks, b)
        if inflight is not None:
            sources, ids = inflight
            patch_inflight(self.input_ids, [padded[x] if i % 2 == 0 else x for i, x in enumerate(sources)], ids)
        if rows is None:
            wanted = [i * self.tokens + len(ids) - 1 for i, (ids, _, _) in enumerate(chunks)]
        else:
            wanted = [padded[r] for r in rows]
        if self.capture:
            graph, logits = self.graphs[b]  # every bucket was captured at start (capture_all)
            graph.replay()
        else:
            logits = self._forward(self._batch(b, q_lens, ctx_lens))
        if not self.logits:
            return torch.empty(0)
        if wanted == list(range(len(wanted))):  # decode steps: the first rows, in order
            return logits[: len(wanted)].clone()
        return logits.index_select(0, to_device(wanted, torch.int64, self.device))

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch, self.cache) if self.logits else self.model.hidden_states(batch, self.cache)

    def release(self) -> None:
        """Destroy the captured graphs now. NCCL does not tear a communicator down while a graph that captured its
        collectives is alive (destroy_process_group waits for them), so a tensor-parallel rank releases its graphs
        before it leaves the group."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    @torch.inference_mode()
    def capture_all(self, agree: Callable[[bool], bool] | None = None) -> None:
        """Capture every bucket now (largest first: the smaller graphs reuse its memory pool). `agree` (tensor
        parallelism): given whether this rank's capture of a bucket succeeded, whether every rank's did; if not,
        every rank drops its graphs and raises CaptureFailed at the same bucket."""
        if not self.capture:
            return
        for b in reversed(self.buckets):
            self._fill([], b)
            batch = self._warm_up(b)
            failure: Exception | None = None
            try:
                self.graphs[b] = self._capture(batch)
            except Exception as exc:
                if agree is None:
                    raise
                failure = exc
            if agree is not None and not agree(failure is None):
                self.graphs.clear()
                where = f"here: {type(failure).__name__}: {failure}" if failure else "on another rank"
                raise CaptureFailed(f"capturing the decode graph of batch {b} failed {where}") from failure

    def _fill(self, chunks: Sequence[Chunk], b: int) -> tuple[list[int], list[int], list[int]]:
        """Copy the step into the static buffers; -> (padded row of each token of the flat batch, n_i, context
        length of each of the b sequences)."""
        t, bs = self.tokens, self.block_size
        ids, positions = [0] * (b * t), [0] * (b * t)
        slots, seq_lens = [self.scratch_slot] * (b * t), [1] * (b * t)
        q_lens, ctx_lens = [1] * b, [1] * b  # padding sequences: one key, the scratch slot
        padded: list[int] = []
        for i, (token_ids, start, table) in enumerate(chunks):
            n, end, first = len(token_ids), start + len(token_ids), i * t
            ids[first:first + n] = token_ids
            positions[first:first + n] = range(start, end)
            slots[first:first + n] = [table[p // bs] * bs + p % bs for p in range(start, end)]
            seq_lens[first:first + n] = [end] * n
            q_lens[i], ctx_lens[i] = n, end
            padded.extend(range(first, first + n))
        blocks = [-(-length // bs) for length in ctx_lens]
        # only the block-table columns some row uses are written: the kernels never read a row past its length, so
        # older entries further right are never looked at (and are valid block ids anyway)
        width = max(blocks)
        flat = array("i")
        scratch = self.scratch_slot // bs
        for i, used in enumerate(blocks):
            flat.extend(chunks[i][2][:used] if i < len(chunks) else [scratch])
            flat.extend(_zeros(width - used))
        host = torch.tensor(ids + positions + slots + seq_lens + q_lens + ctx_lens, dtype=torch.int64)
        staged = to_device(host, torch.int64, self.device)  # pinned: queued, never waiting for the GPU
        tokens = staged[: 4 * b * t].view(4, b * t)
        self.input_ids[: b * t].copy_(tokens[0])
        self.positions[: b * t].copy_(tokens[1])
        self.slots[: b * t].copy_(tokens[2])
        self.seq_lens[: b * t].copy_(tokens[3])
        self.seq_info[:b, 1:].copy_(staged[4 * b * t:].view(2, b).t())
        self.tables[:b, :width].copy_(to_device(torch.frombuffer(flat, dtype=torch.int32).view(b, width), torch.int32,
                                                self.device))
        return padded, q_lens, ctx_lens

    def _batch(self, b: int, q_lens: list[int], ctx_lens: list[int]) -> ForwardBatch:
        """The static buffers' first b sequences as a ForwardBatch. The host tuples describe the same rows for the
        reference attention (eager runs); the Triton attention reads `attention_meta` instead."""
        t = self.tokens
        tables = tuple(self.tables[i, : -(-c // self.block_size)].long() for i, c in enumerate(ctx_lens))
        return ForwardBatch(self.input_ids[: b * t], self.positions[: b * t], self.slots[: b * t],
                            self.seq_lens[: b * t], tuple(range(0, b * t, t)), tuple(q_lens), tuple(ctx_lens), tables,
                            self.logit_rows[: b * t], self.metas[b])

    def _warm_up(self, b: int) -> ForwardBatch:
        """Bucket b's batch, run once eagerly: compiles kernels, tunes W4A16 plans, grows workspaces (and, with
        tensor parallelism, runs the all-reduces for real)."""
        batch = self._batch(b, [1] * b, [1] * b)  # the host tuples are not read by the captured (Triton) path
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return batch

    def _capture(self, batch: ForwardBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool()):
            out = self._forward(batch)
        return graph, out
