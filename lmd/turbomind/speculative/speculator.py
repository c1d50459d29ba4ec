"""The engine's side of speculative decoding: proposals for the decoding speculating sequences before the step is
scheduled, their verification's sampling rows and samples, and the counters.

Order inside `Engine.step` (docs/engine.md): `propose` -> schedule (a chunk takes the sequence's last token and its
proposals, `ScheduledChunk.num_draft`) -> forward (1 + k logits rows per verification) -> `launch` -> resolve, where
the engine keeps the rows up to the first one whose token is not its proposal and calls `record`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmd.turbomind.sampler import PendingSample, Sampler, SamplingRow
from lmd.turbomind.speculative.config import SpeculativeConfig
from lmd.turbomind.speculative.verify import SampledVerification, launch_with_verifications

if TYPE_CHECKING:
    from lmd.turbomind.request_state import RequestState
    from lmd.turbomind.sequence import Sequence
    from lmd.turbomind.speculative.draft import DraftProposer
    from lmd.turbomind.workspace import Workspace

COUNTERS = ("spec_verifications", "spec_proposed_tokens", "spec_accepted_tokens")


class Speculator:
    def __init__(self, config: SpeculativeConfig, target: Workspace, tokenizer: object, num_blocks: int) -> None:
        self.config = config
        self.drafter: DraftProposer | None = None
        if config.method == "draft":
            from lmd.turbomind.speculative.draft import DraftProposer

            self.drafter = DraftProposer(config.model, target, tokenizer, num_blocks)  # type: ignore[arg-type]
        self.counts = dict.fromkeys(COUNTERS, 0)

    def propose(self, running: list[Sequence], states: dict[int, RequestState], max_len: int,
                sampler: Sampler) -> list[Sequence]:
        """Proposals (`Sequence.draft_token_ids`) for the decoding speculating sequences, from their known tokens
        only (their steps are not overlapped, so none has a token in flight); at most what max_tokens leave after
        the verification's own token, so no verification overshoots. The sequences that got some."""
        wanted = []
        for seq in running:
            state = states.get(seq.seq_id)
            if state is None or state.speculative is None or seq.num_inflight or seq.num_uncomputed != 1:
                continue
            room = min(seq.max_num_tokens, max_len) - len(seq.token_ids) - 1
            k = state.speculative.budget(room)
            if k:
                wanted.append((seq, k, state))
        if self.drafter is not None:
            drafts = self.drafter.propose([(seq, k, state.sampling_row) for seq, k, state in wanted], sampler)
            for seq, _, state in wanted:
                seq.draft_token_ids, state.speculative.draft_probs = drafts.get(seq.seq_id, ([], None))  # type: ignore[union-attr]
        else:
            for seq, k, state in wanted:
                seq.draft_token_ids = state.speculative.index.propose(seq.token_ids, k)  # type: ignore[union-attr]
        return [seq for seq, _, _ in wanted if seq.draft_token_ids]

    def launch(self, sampler: Sampler, logits: torch.Tensor, states: list[RequestState],
               drafts: dict[int, tuple[int, ...]]) -> PendingSample:
        """The step's samples; row j of a verification sees the first j proposals as its context, and the rows of a
        sampled request's verification are decided by rejection sampling (`verify.py`)."""
        rows: list[SamplingRow] = []
        verifications: list[SampledVerification] = []
        previous, j = None, 0
        for i, state in enumerate(states):
            j = j + 1 if state is previous else 0
            previous = state
            proposals = drafts.get(state.seq.seq_id, ())
            rows.append(state.sampling_row(proposals[:j]))
            if j == 0 and proposals and not state.config.is_greedy:
                verifications.append(SampledVerification(i, proposals, state.speculative.draft_probs))  # type: ignore[union-attr]
        return launch_with_verifications(sampler, logits, rows, verifications)

    def record(self, state: RequestState, proposed: int, accepted: int) -> None:
        self.counts["spec_verifications"] += 1
        self.counts["spec_proposed_tokens"] += proposed
        self.counts["spec_accepted_tokens"] += accepted
        state.speculative.record(proposed, accepted)  # type: ignore[union-attr]
        state.speculative.draft_probs = None  # type: ignore[union-attr]

    def release(self, seq_id: int) -> None:
        if self.drafter is not None:
            self.drafter.release(seq_id)

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()
