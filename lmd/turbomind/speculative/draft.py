"""The draft-model proposer: a smaller lmd workspace sharing the target's tokenizer proposes greedy chains.

It owns a second ModelRunner and BlockManager (its KV blocks are its own; no prefix cache). Per speculating
sequence it keeps a `Sequence` whose token ids are the target's known tokens followed by its last proposals. Each
step, for the sequences asked:
1. its computed count is cut back to the prefix it shares with the target's tokens (proposals the target rejected
   have KV that no longer matches; accepted ones keep theirs);
2. one forward over every sequence's uncomputed tokens (the target's tokens it has not seen, at least the last)
   gives each its first proposal; then one forward per further proposal, each feeding the previous one.
A sequence whose draft blocks run out gets no proposal this step. The draft's KV is freed when the request ends.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from lmd.errors import LmdError
from lmd.turbomind.block_manager import BlockManager
from lmd.turbomind.model_runner import ModelRunner
from lmd.turbomind.sequence import Sequence
from lmd.turbomind.workspace import Workspace, open_workspace


class DraftProposer:
    def __init__(self, path: str | Path, target: Workspace, target_tokenizer: object, num_blocks: int) -> None:
        cfg = target.engine  # the draft runs where the target runs, with as many (smaller) blocks
        ws = open_workspace(path, device=cfg.device, dtype=cfg.dtype, cache_block_seq_len=cfg.cache_block_seq_len,
                            cache_max_entry_count=max(num_blocks, 2), max_batch_size=cfg.max_batch_size,
                            session_len=cfg.session_len, cuda_graph=False)
        if ws.model.vocab_size != target.model.vocab_size:
            raise LmdError(f"--speculative-model {path}: vocab_size {ws.model.vocab_size} differs from the target's "
                           f"{target.model.vocab_size}; the draft must share the target's tokenizer")
        if ws.load_tokenizer().get_vocab() != target_tokenizer.get_vocab():  # type: ignore[attr-defined]
            raise LmdError(f"--speculative-model {path}: its tokenizer differs from the target's; use a draft "
                           "deployed from a model of the same tokenizer")
        self.runner = ModelRunner(ws)
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.cache_block_seq_len, enable_caching=False)
        self._seqs: dict[int, Sequence] = {}

    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Greedy chains of k tokens after each target sequence's known tokens (seq_id -> proposals)."""
        batch: list[tuple[Sequence, int]] = []
        for target, k in requests:
            seq = self._seqs.setdefault(target.seq_id, Sequence(target.seq_id, []))
            seq.num_computed_tokens = min(seq.num_computed_tokens, _shared_prefix(seq.token_ids, target.token_ids))
            seq.token_ids = list(target.token_ids)
            new = len(seq.token_ids) - seq.num_computed_tokens
            if self.block_manager.append_slots(seq, new + k - 1):  # KV of the tokens fed: all but the last proposal
                batch.append((seq, k))
        out: dict[int, list[int]] = {seq.seq_id: [] for seq, _ in batch}
        chunks = [(seq.token_ids[seq.num_computed_tokens:], seq.num_computed_tokens, seq.block_table)
                  for seq, _ in batch]
        for step in range(max((k for _, k in batch), default=0)):
            rows = [end - 1 for end in itertools.accumulate(len(ids) for ids, _, _ in chunks)]
            logits = self.runner.run_chunks(chunks, rows)
            tokens = logits.argmax(dim=-1).tolist()
            next_chunks, next_batch = [], []
            for (seq, k), (ids, start, table), token in zip(batch, chunks, tokens, strict=True):
                seq.num_computed_tokens = start + len(ids)
                seq.token_ids.append(token)
                out[seq.seq_id].append(token)
                if step + 1 < k:
                    next_chunks.append(([token], seq.num_computed_tokens, table))
                    next_batch.append((seq, k))
            chunks, batch = next_chunks, next_batch
        return out

    def release(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.block_manager.free(seq)

    def close(self) -> None:
        self.runner.close()


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
