"""Beam search's bookkeeping for one request, by transformers' rules (`generate(num_beams=k, do_sample=False)`).

Each round every running beam contributes its top 2k continuations (cumulative logprob + the token's logprob, in
float32 as transformers adds them); of the best 2k over all beams:
- the first k that end (an eos / stop token, or the length limit) become finished hypotheses, scored
  cumulative / generated_length ** length_penalty, and the best k hypotheses are kept;
- the best k that do not end are the next round's beams (a beam may be the parent of several, or of none).
The search ends when every candidate ends, when `early_stopping=True` and k hypotheses are finished, or when no
running beam can still beat the worst kept hypothesis (transformers' heuristic: the best running score judged at its
present length, or at the length limit with `early_stopping="never"` and a positive length penalty).

No tensors of the model and no KV here: the engine (`beam_request.py`) turns each round's choice into forks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Candidate:
    beam: int  # index of the parent beam in this round
    token: int
    score: float  # cumulative logprob with this token (float32 value)


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # generated tokens, the ending token included
    score: float  # cumulative logprob / generated_length ** length_penalty
    ends_by_token: bool  # an eos / stop token (finish "stop"), else the length limit ("length")


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


class BeamSearch:
    def __init__(self, width: int, length_penalty: float, early_stopping: bool | str, end_ids: tuple[int, ...],
                 max_new_tokens: int) -> None:
        self.width, self.length_penalty, self.early_stopping = width, length_penalty, early_stopping
        self.end_ids, self.max_new_tokens = frozenset(end_ids), max_new_tokens
        # transformers keeps (1 + number of eos ids) * k candidates, at least 2k, so k of them do not end
        self.num_candidates = max(2, 1 + len(end_ids)) * width
        self.generated: list[tuple[int, ...]] = [()]  # per running beam; one beam before the first round
        self.scores: list[float] = [0.0]  # cumulative logprob per running beam
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self._improvable = True
        self.done = False

    @property
    def num_generated(self) -> int:
        return len(self.generated[0])

    def candidates(self, beam: int, logprobs: torch.Tensor, token_ids: torch.Tensor) -> list[Candidate]:
        """A beam's continuations from its top logprobs (float32, on the host), scored as transformers adds them."""
        totals = logprobs.to(torch.float32) + _f32(self.scores[beam])
        return [Candidate(beam, int(t), float(s)) for t, s in zip(token_ids.tolist(), totals.tolist(), strict=True)]

    def advance(self, candidates: list[Candidate]) -> list[Candidate]:
        """One round: `candidates` are every running beam's; returns the next round's beams (empty when done)."""
        # best first; on equal scores the lower flattened (beam, token) index first, as torch.topk tends to
        ranked = sorted(candidates, key=lambda c: (-c.score, c.beam, c.token))[:self.num_candidates]
        length = self.num_generated + 1  # of every candidate
        at_limit = length >= self.max_new_tokens
        ends = [at_limit or c.token in self.end_ids for c in ranked]
        full = self.early_stopping is True and len(self.finished) == self.width
        if self._improvable and not full:
            new = [self._hypothesis(c, c.token in self.end_ids)
                   for c, end in zip(ranked[:self.width], ends[:self.width], strict=True) if end]
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:self.width]
        running = [c for c, end in zip(ranked, ends, strict=True) if not end][:self.width]
        if at_limit or not running:
            self.done = True
            return []
        self.generated = [self.generated[c.beam] + (c.token,) for c in running]
        self.scores = [c.score for c in running]
        self._improvable = self._improvable and self._can_improve()
        if not self._improvable or (self.early_stopping is True and len(self.finished) == self.width):
            self.done = True
            return []
        return running

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]

    def _hypothesis(self, c: Candidate, ends_by_token: bool) -> Hypothesis:
        length = self.num_generated + 1
        score = float(_f32(c.score) / (length ** self.length_penalty))
        return Hypothesis(self.generated[c.beam] + (c.token,), score, ends_by_token)

    def _can_improve(self) -> bool:
        """Can the best running beam still beat the worst of `width` finished hypotheses?"""
        if len(self.finished) < self.width:
            return True
        judged_at_limit = self.early_stopping == "never" and self.length_penalty > 0
        length = self.max_new_tokens if judged_at_limit else self.num_generated
        best_running = float(_f32(self.scores[0]) / (length ** self.length_penalty))
        return best_running > self.finished[-1].score
