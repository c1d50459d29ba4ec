"""One request's speculation: its proposer, how many tokens to propose, and the back-off that stops proposing while
proposals keep failing.

Length: a verification computes 1 + k positions, and on a CPU (compute-bound at a few rows) each extra position
costs a fair part of a decode step (SmolLM2 fp32: ~11 ms on a 64 ms step), so a proposal pays only if it is likely
to be accepted. Proposals are accepted in runs, so the next proposal is as long as the last accepted run plus one
(so one more when every proposal was accepted, up to K): a copy in progress keeps growing, a diverging one stays short.

Back-off: a verification whose drafts are all rejected costs k extra positions for no token; after one, the
request decodes plainly for `skip` steps (1, 2, 4, ... up to MAX_SKIP, doubling at each further failure), and any
accepted draft resets it. Work with little to copy (chat) so pays for a few failed verifications only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmd.turbomind.speculative.config import SpeculativeConfig
from lmd.turbomind.speculative.ngram import NgramIndex

if TYPE_CHECKING:
    import torch

    from lmd.turbomind.speculative.tree import TreeProposal

MAX_SKIP = 16


class SpeculativeRequest:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_k = config.num_speculative_tokens
        self.k = self.max_k  # the next proposal's length
        self.index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        self.draft_probs: torch.Tensor | None = None  # a draft model's q of the sampled proposals being verified
        self.tree: TreeProposal | None = None  # the token tree proposed this step (--speculative-tree)
        self._skip = 0  # plain steps left before the next proposal
        self._backoff = 1

    def budget(self, room: int) -> int:
        """How many tokens to propose this step (0: decode plainly); at most `room` (tokens the request may still
        make, minus the one the verification makes anyway)."""
        if self._skip:
            self._skip -= 1
            return 0
        return max(0, min(self.k, room))

    def propose(self, token_ids: list[int], room: int) -> list[int]:
        """N-gram proposals after `token_ids`, `budget(room)` at most."""
        k = self.budget(room)
        return self.index.propose(token_ids, k) if k else []

    def record(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        self.k = min(self.max_k, accepted + 1)
        if accepted:
            self._skip, self._backoff = 0, 1
        else:
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff, MAX_SKIP)
