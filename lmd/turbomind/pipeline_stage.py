"""Pipeline parallelism: which layers a stage holds, the micro-batches of a step, the activations between stages.

The decoder layers are cut into pp contiguous stages (the first ones get one more when they do not divide); stage 0
also holds the embedding, the last stage the final norm and the lm_head. Every rank gets the whole step's batch from
the driver and cuts it into the same micro-batches (contiguous chunks, about equal tokens): stage s computes micro-batch
i + 1 while stage s + 1 computes micro-batch i. Between stages go the residual stream and the last MLP output not yet
added (exactly what the next layer takes, so the split changes no arithmetic), from each tensor-parallel rank to the
same rank of the next stage; the last stage's rank 0 sends the logits to the driver (global rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def layout_lines(num_layers: int, tp: int, pp: int) -> list[str]:
    """What each global rank holds, for the start-up log and the docs."""
    lines = []
    for rank in range(tp * pp):
        stage = rank // tp
        layers = stage_layers(num_layers, pp, stage)
        parts = [f"layers {layers.start}-{layers.stop - 1}"]
        if stage == 0:
            parts.insert(0, "embedding")
        if stage == pp - 1:
            parts.append("norm + lm_head")
        role = "driver: schedules, samples" if rank == 0 else "worker"
        lines.append(f"rank {rank} (stage {stage}, tp rank {rank % tp}): {', '.join(parts)}; {role}")
    return lines


@dataclass(frozen=True)
class MicroBatch:
    chunks: list[tuple[list[int], int, list[int]]]
    rows: list[int]  # logit rows, relative to this micro-batch's flat tokens


def micro_batches(chunks: list[tuple[list[int], int, list[int]]], rows: list[int], count: int) -> list[MicroBatch]:
    """`count` (at most one per chunk) contiguous groups of chunks with about equal tokens; `rows` (ascending, flat
    over the whole batch) split and rebased. Deterministic: every rank cuts the same way."""
    sizes = [len(c[0]) for c in chunks]
    count = max(1, min(count, len(chunks)))
    total, bounds, acc, cut = sum(sizes), [0], 0, 1
    for i, size in enumerate(sizes[:-1]):
        acc += size
        left = len(chunks) - (i + 1)  # chunks after this one
        if cut < count and (acc * count >= cut * total or left == count - cut):
            bounds.append(i + 1)
            cut += 1
    bounds.append(len(chunks))
    out, offset = [], 0
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        tokens = sum(sizes[lo:hi])
        out.append(MicroBatch(chunks[lo:hi], [r - offset for r in rows if offset <= r < offset + tokens]))
        offset += tokens
    return out


class StageLink:
    """This rank's neighbours in the pipeline (global ranks of the default group)."""

    def __init__(self, rank: int, tp: int, pp: int) -> None:
        self.stage, self.tp_rank = divmod(rank, tp)
        self.first, self.last = self.stage == 0, self.stage == pp - 1
        self._prev = rank - tp if not self.first else None
        self._next = rank + tp if not self.last else None
        self._logits_from = (pp - 1) * tp  # the last stage's tp rank 0
        self._sends: list = []

    @property
    def sends_logits(self) -> bool:
        return self.last and self.tp_rank == 0

    def send_carry(self, h: torch.Tensor, delta: torch.Tensor) -> None:
        import torch.distributed as dist

        packed = torch.stack((h, delta))
        self._sends.append((dist.isend(packed, self._next), packed))  # the tensor lives until the send completes

    def recv_carry(self, tokens: int, hidden: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        packed = torch.empty(2, tokens, hidden, dtype=dtype, device=device)
        dist.recv(packed, self._prev)
        return packed[0], packed[1]

    def send_logits(self, logits: torch.Tensor) -> None:
        import torch.distributed as dist

        logits = logits.contiguous()
        self._sends.append((dist.isend(logits, 0), logits))

    def recv_logits(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        import torch.distributed as dist

        logits = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        dist.recv(logits, self._logits_from)
        return logits

    def wait_sends(self) -> None:
        """Before the step's buffers are reused or freed."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
