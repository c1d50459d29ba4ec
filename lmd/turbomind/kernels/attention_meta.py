"""The paged-attention kernels' per-batch metadata: the batch's lengths, decode tiles and padded block tables on the
device (`attention_meta`, built once per batch and shared by every layer), and the prefill tiles per tile height."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmd.turbomind.kernels.host_copy import to_device


@dataclass
class AttentionMeta:
    num_tokens: int  # rows of the flat batch (q's first dim)
    seq_info: torch.Tensor  # [B, 3] int32: first row in the flat batch, query length, context length
    decode_tiles: torch.Tensor  # [num_decode, 2] int32: (sequence, 0) of the sequences with one new token
    tables: torch.Tensor  # [B, max blocks] int32, rows zero-padded
    max_decode_ctx: int
    prefill: list[tuple[int, int, int]]  # (sequence, query length, context length) of the longer chunks
    tiles: dict[int, torch.Tensor] = field(default_factory=dict)  # tokens per tile -> [tiles, 2] int32

    def prefill_tiles(self, block_q: int) -> torch.Tensor:
        """(sequence, first query token) of every tile of block_q tokens, those that see the most keys first (the
        grid's tail is then short tiles)."""
        if block_q not in self.tiles:
            work = [
                (ctx - n + min(q0 + block_q, n), seq, q0) for seq, n, ctx in self.prefill for q0 in range(0, n, block_q)
            ]
            work.sort(reverse=True)
            flat = [x for _, seq, q0 in work for x in (seq, q0)]
            self.tiles[block_q] = to_device(flat, torch.int32, self.seq_info.device).view(-1, 2)
        return self.tiles[block_q]


def attention_meta(
    q_starts: Sequence[int],
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    block_tables: Sequence[torch.Tensor],
    device: torch.device,
) -> AttentionMeta:
    """The kernels' metadata of a batch: one host-to-device copy for the lengths, one for the tables, neither
    waiting for the GPU.

    Triton compiles a kernel again for every new specialization of its arguments (an int equal to 1 or divisible by
    16, a pointer aligned to 16 bytes), a host stall inside some step on a fresh machine. So the decode tiles start
    16-byte aligned in the packed copy and the tables' row stride is a multiple of 16 columns whatever the batch:
    the kernels see one specialization."""
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    prefill = [(i, n, ctx) for i, (n, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)) if n > 1]
    b = len(q_lens)
    host = [x for row in zip(q_starts, q_lens, ctx_lens, strict=True) for x in row]
    tiles_at = -(-3 * b // 4) * 4
    host += [0] * (tiles_at - 3 * b) + [x for i in decode for x in (i, 0)]
    packed = to_device(host, torch.int32, device)
    if b:  # ForwardBatch.build keeps the tables on the host: padded there, one copy
        padded = torch.nn.utils.rnn.pad_sequence([t.cpu() for t in block_tables], batch_first=True)
        width = max(16, -(-padded.shape[1] // 16) * 16)
        tables = to_device(torch.nn.functional.pad(padded, (0, width - padded.shape[1])), torch.int32, device)
    else:
        tables = torch.zeros((0, 0), dtype=torch.int32, device=device)
    max_decode_ctx = max((ctx_lens[i] for i in decode), default=0)
    return AttentionMeta(
        sum(q_lens),
        packed[: 3 * b].view(b, 3),
        packed[tiles_at:].view(-1, 2),
        tables.to(torch.int32).contiguous(),
        max_decode_ctx,
        prefill,
    )
