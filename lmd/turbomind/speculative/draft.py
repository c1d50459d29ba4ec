"""The draft-model proposer: a smaller lmd workspace sharing the target's tokenizer proposes chains, drawn with the
request's own sampling settings (greedy: the processed argmax; sampled: from the draft's processed distribution q,
which is kept for the verification's rejection rule, `verify.py`).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmd.errors import LmdError
from lmd.turbomind.block_manager import BlockManager
from lmd.turbomind.kernels.host_copy import to_device
from lmd.turbomind.model_runner import ModelRunner
from lmd.turbomind.sampler import Sampler, SamplingRow, draw, processed_logits, sampling_probs
from lmd.turbomind.sequence import Sequence
from lmd.turbomind.workspace import Workspace, open_workspace

# a request's sampling row after these proposals (its penalties and min_new_tokens count them as generated)
RowOf = Callable[[tuple[int, ...]], SamplingRow]


@dataclass
class DraftChain:
    tokens: list[int] = field(default_factory=list)  # the chain proposed
    candidates: list[list[int]] = field(default_factory=list)  # per depth: the chain's token, then the alternatives
    probs: list[torch.Tensor] = field(default_factory=list)  # per depth: q, for a sampled request

    def q(self) -> torch.Tensor | None:
        return torch.stack(self.probs) if self.probs else None


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

    def propose(self, requests: list[tuple[Sequence, int, RowOf]], sampler: Sampler,
                branch: int = 1) -> dict[int, DraftChain]:
        """Chains of k tokens after each target sequence's known tokens, with `branch` candidates per depth (token
        trees: the chain's token first), seq_id -> DraftChain."""
        batch: list[tuple[Sequence, int, RowOf]] = []
        for target, k, row_of in requests:
            seq = self._seqs.setdefault(target.seq_id, Sequence(target.seq_id, []))
            seq.num_computed_tokens = min(seq.num_computed_tokens, _shared_prefix(seq.token_ids, target.token_ids))
            seq.token_ids = list(target.token_ids)
            new = len(seq.token_ids) - seq.num_computed_tokens
            if self.block_manager.append_slots(seq, new + k - 1):  # KV of the tokens fed: all but the last proposal
                batch.append((seq, k, row_of))
        out = {seq.seq_id: DraftChain() for seq, _, _ in batch}
        chunks = [(seq.token_ids[seq.num_computed_tokens:], seq.num_computed_tokens, seq.block_table)
                  for seq, _, _ in batch]
        for step in range(max((k for _, k, _ in batch), default=0)):
            positions = [end - 1 for end in itertools.accumulate(len(ids) for ids, _, _ in chunks)]
            raw = self.runner.run_chunks(chunks, positions).float()
            rows = [row_of(tuple(out[seq.seq_id].tokens)) for seq, _, row_of in batch]
            candidates, q = _choose(sampler, raw, rows, branch)
            next_chunks, next_batch = [], []
            for i, ((seq, k, row_of), (ids, start, table)) in enumerate(zip(batch, chunks, strict=True)):
                token = candidates[i][0]
                seq.num_computed_tokens = start + len(ids)
                seq.token_ids.append(token)
                chain = out[seq.seq_id]
                chain.tokens.append(token)
                chain.candidates.append(candidates[i])
                if q is not None and not rows[i].config.is_greedy:
                    chain.probs.append(q[i])
                if step + 1 < k:
                    next_chunks.append(([token], seq.num_computed_tokens, table))
                    next_batch.append((seq, k, row_of))
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


def _choose(sampler: Sampler, raw: torch.Tensor, rows: list[SamplingRow],
            branch: int) -> tuple[list[list[int]], torch.Tensor | None]:
    """Each row's `branch` candidates, the chain's token first: greedy rows the top of the processed logits (the
    argmax first), sampled rows i.i.d. draws from q, their processed distribution (returned; greedy rows' left 0)."""
    device = raw.device
    sampled = [i for i, row in enumerate(rows) if not row.config.is_greedy]
    greedy = [i for i, row in enumerate(rows) if row.config.is_greedy]
    out: list[list[int]] = [[] for _ in rows]
    if greedy:
        index = to_device(greedy, torch.int64, device)
        picked = [rows[i] for i in greedy]
        if branch == 1:
            top = sampler.choose(raw[index], picked).unsqueeze(1)
        else:
            top = processed_logits(raw[index], picked).topk(branch, dim=-1).indices
        for i, ids in zip(greedy, top.tolist(), strict=True):
            out[i] = ids
    if not sampled:
        return out, None
    index = to_device(sampled, torch.int64, device)
    picked = [rows[i] for i in sampled]
    q = torch.zeros_like(raw)
    q[index] = sampling_probs(raw[index], picked)
    draws = torch.stack([draw(q[index], sampler.uniforms(picked, device)) for _ in range(branch)], dim=1)
    for i, ids in zip(sampled, draws.tolist(), strict=True):
        out[i] = ids
    return out, q
