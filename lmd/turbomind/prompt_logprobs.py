"""Prompt logprobs from the prefill's own logits: the logits at position i give the logprob of prompt token i + 1.

A request asking for them (`GenerationConfig.prompt_logprobs`) has every position of its prompt chunks computed
(`ScheduledChunk.all_logits`; it takes no prefix-cache hits, since cached blocks hold KV but no logits). Per chunk,
the targets are the prompt tokens start + 1 .. min(start + n, prompt length - 1) not yet covered (a preempted
request recomputes its prompt, and positions it already has are skipped). The values are computed on the device
and copied to pinned host memory without waiting; `PendingPromptLogprobs.resolve` reads them once the step's sample
event has passed (the copies are queued before it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmd.turbomind.kernels.host_copy import to_device, to_host
from lmd.turbomind.request_stream import PromptEntry
from lmd.turbomind.scheduler import ScheduledChunk

ROWS_PER_SLICE = 512  # log_softmax over the vocabulary in slices: [rows, vocab] fp32 stays bounded


@dataclass
class PromptTargets:
    """One chunk's share: logits rows [row, row + count) give the logprobs of prompt tokens first .. first+count-1."""

    seq_id: int
    row: int
    first: int
    count: int
    top: int  # alternatives wanted per token


def plan(chunk: ScheduledChunk, row: int, prompt_len: int, done: int, top: int) -> PromptTargets | None:
    """Targets of an all_logits chunk whose logits start at `row`; `done`: prompt tokens already covered (token 0
    counts as covered: it has no logprob). A recomputed chunk (after preemption) may run on into generated tokens:
    only prompt tokens are targets."""
    first = max(chunk.start + 1, done)
    last = min(chunk.start + len(chunk.token_ids), prompt_len - 1)  # inclusive: position p predicts token p + 1
    if last < first:
        return None
    return PromptTargets(chunk.seq_id, row + first - 1 - chunk.start, first, last - first + 1, top)


class PendingPromptLogprobs:
    def __init__(self, logits: torch.Tensor, targets: list[PromptTargets], prompt_ids: dict[int, list[int]]) -> None:
        self.targets = targets
        device = logits.device
        rows = [t.row + i for t in targets for i in range(t.count)]
        ids = [prompt_ids[t.seq_id][t.first + i] for t in targets for i in range(t.count)]
        k = max(t.top for t in targets)
        row_index, id_index = to_device(rows, torch.int64, device), to_device(ids, torch.int64, device)
        picked, top_values, top_ids = [], [], []
        for s in range(0, len(rows), ROWS_PER_SLICE):
            lp = logits[row_index[s:s + ROWS_PER_SLICE]].float().log_softmax(dim=-1)
            picked.append(lp.gather(1, id_index[s:s + ROWS_PER_SLICE, None]).squeeze(1))
            if k:
                values, indices = lp.topk(k, dim=-1)
                top_values.append(values)
                top_ids.append(indices)
        # queued before the step's sample event, which resolve() runs after
        self._host = to_host([torch.cat(picked)] + ([torch.cat(top_values), torch.cat(top_ids)] if k else []))

    def resolve(self) -> dict[int, list[PromptEntry]]:
        """seq_id -> the entries of its targets, in order (call after the step's sample event)."""
        picked = self._host[0].tolist()
        top_values = self._host[1].tolist() if len(self._host) > 1 else None
        top_ids = self._host[2].tolist() if len(self._host) > 1 else None
        out: dict[int, list[PromptEntry]] = {}
        i = 0
        for t in self.targets:
            entries = out.setdefault(t.seq_id, [])
            for _ in range(t.count):
                alternatives = () if top_ids is None or not t.top else tuple(
                    zip(top_ids[i][: t.top], top_values[i][: t.top], strict=True))  # type: ignore[index]
                entries.append((picked[i], alternatives))
                i += 1
        return out
