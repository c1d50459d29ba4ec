"""One request's speculation: its proposer and the back-off that stops proposing while proposals keep failing.

A verification whose drafts are all rejected costs a forward of K + 1 positions for one token; after one, the
request decodes plainly for `skip` steps (1, 2, 4, ... up to MAX_SKIP, doubling at each further failure), and any
accepted draft resets it. Work with little to copy (chat) so pays for a few failed verifications only.
"""

from __future__ import annotations

from lmd.turbomind.speculative.config import SpeculativeConfig
from lmd.turbomind.speculative.ngram import NgramIndex

MAX_SKIP = 16


class SpeculativeRequest:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        self._skip = 0  # plain steps left before the next proposal
        self._backoff = 1

    def propose(self, token_ids: list[int], room: int) -> list[int]:
        """Draft tokens to verify after `token_ids`; at most `room` (tokens the request may still make, minus the
        one the verification makes anyway)."""
        if self._skip:
            self._skip -= 1
            return []
        return self.index.propose(token_ids, min(self.k, room))

    def record(self, proposed: int, accepted: int) -> None:
        if accepted:
            self._skip, self._backoff = 0, 1
        elif proposed:
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff, MAX_SKIP)
