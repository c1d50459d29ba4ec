"""The engine's running beam searches (`beam_request.BeamRequest`): which batch sequence belongs to which search, the
beam rows of the step being computed, and what the engine does with them — admit a search, advance its round from a
step's logits, free it, and free blocks for a search that waits on a sibling. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lmd.turbomind.kernels.host_copy import to_device

if TYPE_CHECKING:
    from lmd.turbomind.beam_request import BeamRequest
    from lmd.turbomind.block_manager import BlockManager
    from lmd.turbomind.model_runner import ModelRunner
    from lmd.turbomind.scheduler import Scheduler, SchedulerOutput


class BeamSearches:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, runner: ModelRunner, tokenizer: Any,
                 new_seq_id: Callable[[], int], forget_ids: Callable[[list[object]], None]) -> None:
        """forget_ids: drop a finished search's request ids from the engine's id map (under its lock)."""
        self.scheduler, self.block_manager, self.runner, self.tokenizer = scheduler, block_manager, runner, tokenizer
        self._new_seq_id, self._forget_ids = new_seq_id, forget_ids
        self.of_seq: dict[int, BeamRequest] = {}  # seq_id of a running beam -> its search
        self.by_request_id: dict[object, BeamRequest] = {}  # every request id of a search -> the search
        self.rows: list[tuple[int, int]] = []  # (seq_id, logits row) of the step being computed

    def __bool__(self) -> bool:
        """Some search is running."""
        return bool(self.of_seq)

    def admit(self, request: BeamRequest) -> None:
        self.of_seq[request.beams[0].seq_id] = request
        for rid in request.request_ids:
            self.by_request_id[rid] = request
        self.scheduler.add(request.beams[0])

    def advance(self, logits: torch.Tensor) -> int:
        """This step's beam rows: each beam's top continuations to the host; every search whose beams have all
        reported decides its round, forks and frees beams, and ends when it is done. Returns the rows taken (one
        candidate token per beam and round)."""
        beam_rows, self.rows = self.rows, []
        width = min(logits.shape[1], max(self.of_seq[seq_id].num_candidates for seq_id, _ in beam_rows))
        picked = logits[to_device([r for _, r in beam_rows], torch.int64, logits.device)]
        logprobs, token_ids = torch.log_softmax(picked.float(), dim=-1).topk(width, dim=-1)
        logprobs, token_ids = logprobs.cpu(), token_ids.cpu()
        for i, (seq_id, _) in enumerate(beam_rows):
            request = self.of_seq[seq_id]
            n = request.num_candidates
            if not request.report(seq_id, logprobs[i, :n], token_ids[i, :n]):
                continue
            parents = [beam.seq_id for beam in request.beams]
            request.advance(self.scheduler, self.block_manager,
                            lambda src, dst: self.runner.cache.copy_blocks([src], [dst]),
                            self._new_seq_id, can_share=self.runner.world == 1)
            for parent in parents:
                self.of_seq.pop(parent)
            if request.search.done:
                self.finish(request, None)
                continue
            for beam in request.beams:
                self.of_seq[beam.seq_id] = request
        return len(beam_rows)

    def finish(self, request: BeamRequest, reason: str | None) -> None:
        """Free every beam of the search; its streams get the n best hypotheses (reason None) or empty ends."""
        request.release(self.scheduler)
        for beam in request.beams:
            self.of_seq.pop(beam.seq_id, None)
        for rid in request.request_ids:
            self.by_request_id.pop(rid, None)
        self._forget_ids(request.request_ids)
        for stream, delta in zip(request.streams, request.final_deltas(self.tokenizer, reason), strict=True):
            stream.put(delta)

    def finish_all(self, reason: str) -> None:
        for request in list(dict.fromkeys(self.by_request_id.values())):
            self.finish(request, reason)

    def unblock(self) -> SchedulerOutput | None:
        """Nothing scheduled while beams idle, waiting for a sibling that no free block admits: the newest other
        searches' idle beams give their blocks back (they recompute later, mostly from the prefix cache)."""
        head = self.scheduler.waiting[0] if self.scheduler.waiting else None
        blocking = self.of_seq.get(head.seq_id) if head is not None else None
        victims = [seq for seq in reversed(self.scheduler.running)
                   if seq.seq_id in self.of_seq and self.of_seq[seq.seq_id] is not blocking]
        if head is None or not victims:
            return None
        for seq in victims:
            self.scheduler.preempt(seq, to_back=True)
        return self.scheduler.schedule()
