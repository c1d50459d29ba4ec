"""The tensors of one model forward: a flat run of tokens from many sequences (prefill chunks and decodes mixed).

Sequence i owns tokens [q_starts[i], q_starts[i] + q_lens[i]) of the flat batch; they sit at positions
[ctx_lens[i] - q_lens[i], ctx_lens[i]) of that sequence, whose KV (these tokens included, once written) lives in the
blocks of block_tables[i].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmd.turbomind.kernels.host_copy import to_device
from lmd.turbomind.sequence import INFLIGHT


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64: cache slot of each token
    token_seq_lens: torch.Tensor  # [T] int64: ctx_len of each token's sequence (dynamic NTK RoPE)
    q_starts: tuple[int, ...]
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    block_tables: tuple[torch.Tensor, ...]  # each [ceil(ctx_len / block_size)] int64, on the host (built) or device
    logit_indices: torch.Tensor  # [R] rows of the flat batch whose logits are wanted
    attention_meta: object | None = None  # prebuilt device metadata of the attention kernels (decode graphs)
    tree: object | None = None  # speculative token trees: tree_attention.TreeRows of the chunks that are trees

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, chunks: list[tuple[list[int], int, list[int]]], block_size: int, logit_rows: list[int],
              device: torch.device) -> ForwardBatch:
        """chunks: (token ids of this step, start position, block table) per sequence."""
        ids, positions, slots, seq_lens = [], [], [], []
        q_starts, q_lens, ctx_lens, tables = [], [], [], []
        for tokens, start, table in chunks:
            q_starts.append(len(ids))
            q_lens.append(len(tokens))
            ctx = start + len(tokens)
            ctx_lens.append(ctx)
            ids.extend(tokens)
            for pos in range(start, ctx):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            seq_lens.extend([ctx] * len(tokens))
            tables.append(torch.tensor(table[: -(-ctx // block_size)], dtype=torch.int64))
        # one copy for the four token vectors and the logit rows, queued without waiting for the GPU
        flat = to_device(ids + positions + slots + seq_lens + list(logit_rows), torch.int64, device)
        t = len(ids)
        return cls(flat[:t], flat[t:2 * t], flat[2 * t:3 * t], flat[3 * t:4 * t], tuple(q_starts), tuple(q_lens),
                   tuple(ctx_lens), tuple(tables), flat[4 * t:])


@dataclass(frozen=True)
class InflightIds:
    """The ids the step still running samples: row of each sequence in `token_ids` (a device tensor)."""

    rows: dict[int, int]  # seq_id -> row
    token_ids: torch.Tensor

    def sources(self, chunks: Sequence[tuple[int, Sequence[int]]]) -> list[int] | None:
        """(position in the flat batch, row in token_ids) of every INFLIGHT id of (seq_id, token ids) chunks,
        flattened; None when every id is known. Only a chunk's last id can be in flight (the token after the known
        ones), so this looks at one id per chunk."""
        out, end = [], 0
        for seq_id, ids in chunks:
            end += len(ids)
            if ids and ids[-1] == INFLIGHT:
                out += [end - 1, self.rows[seq_id]]
        return out or None


def patch_inflight(input_ids: torch.Tensor, sources: list[int], inflight: torch.Tensor) -> None:
    """input_ids[p] = inflight[r] for each (p, r) pair of `sources` (flattened), on the device: a token sampled by
    the step still running becomes this step's input without coming back to the host first (overlap)."""
    pairs = to_device(sources, torch.int64, input_ids.device).view(-1, 2)
    input_ids[pairs[:, 0]] = inflight[pairs[:, 1]]
