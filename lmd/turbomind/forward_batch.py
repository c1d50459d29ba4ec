"""The tensors of one model forward: a flat run of tokens from many sequences (prefill chunks and decodes mixed).

Sequence i owns tokens [q_starts[i], q_starts[i] + q_lens[i]) of the flat batch; they sit at positions
[ctx_lens[i] - q_lens[i], ctx_lens[i]) of that sequence, whose KV (these tokens included, once written) lives in the
blocks of block_tables[i].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64: cache slot of each token
    token_seq_lens: torch.Tensor  # [T] int64: ctx_len of each token's sequence (dynamic NTK RoPE)
    q_starts: tuple[int, ...]
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    block_tables: tuple[torch.Tensor, ...]  # each [ceil(ctx_len / block_size)] int64
    logit_indices: torch.Tensor  # [R] rows of the flat batch whose logits are wanted
    attention_meta: object | None = None  # prebuilt device metadata of the attention kernels (decode graphs)

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
            tables.append(torch.tensor(table[: -(-ctx // block_size)], dtype=torch.int64, device=device))

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(as_tensor(ids), as_tensor(positions), as_tensor(slots), as_tensor(seq_lens), tuple(q_starts),
                   tuple(q_lens), tuple(ctx_lens), tuple(tables), as_tensor(logit_rows))
