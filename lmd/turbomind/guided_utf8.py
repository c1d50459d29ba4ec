"""What xgrammar's byte-level matching lets through that is no UTF-8: encoded surrogates.

xgrammar 0.2.9 matches a grammar's characters byte by byte and takes ED A0..BF xx (the three-byte form of U+D800 to
U+DFFF, which UTF-8 forbids) as one character. A reply can then hold bytes that decode to U+FFFD, and a string that
the grammar counted as within maxLength decodes longer (seen: "_ Neuro" + ED A0 80 under maxLength 8, ten characters
after decoding). Overlong forms, bytes past U+10FFFF and stray continuation bytes it already refuses.

`SurrogateGuard` keeps them out of every guided reply with two masks over the vocabulary's raw bytes (xgrammar's own
`decoded_vocab`): tokens whose bytes hold ED followed by A0..BF are never allowed, and tokens that begin with a byte
A0..BF are not allowed right after text that ends in a lead byte ED. Per request, one flag per accepted token (so
rollback and fork stay exact): whether the reply then ends in a lone ED.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LEAD = 0xED  # lead byte of U+D000..U+DFFF; the surrogates are its second bytes A0..BF
SURROGATE_SECOND = range(0xA0, 0xC0)


def _clear(mask: torch.Tensor, index: int) -> None:
    word, bit = divmod(index, 32)
    mask[word] &= ~(-(1 << 31) if bit == 31 else 1 << bit)


class SurrogateGuard:
    """Masks for one vocabulary: `anywhere` (int32 bitmask words, AND into every guided row) and `after_lead` (AND in
    when the reply so far ends in a lone ED); `ends_in_lead`: the tokens whose bytes end in ED."""

    def __init__(self, decoded_vocab: Sequence[bytes], words: int) -> None:
        self.anywhere = torch.full((words,), -1, dtype=torch.int32)
        self.after_lead = torch.full((words,), -1, dtype=torch.int32)
        self.ends_in_lead: set[int] = set()
        self.empty: set[int] = set()  # tokens without bytes (special tokens): the reply's last byte stays
        for index, raw in enumerate(decoded_vocab):
            if not raw:
                self.empty.add(index)
                continue
            if any(raw[i] == LEAD and raw[i + 1] in SURROGATE_SECOND for i in range(len(raw) - 1)):
                _clear(self.anywhere, index)
            if raw[0] in SURROGATE_SECOND:
                _clear(self.after_lead, index)
            if raw[-1] == LEAD:
                self.ends_in_lead.add(index)

    def apply(self, bitmask_row: torch.Tensor, after_lead: bool) -> None:
        bitmask_row &= self.anywhere
        if after_lead:
            bitmask_row &= self.after_lead


class LeadState:
    """Per request: after each accepted token, whether the reply ends in a lone ED (a stack, for rollback)."""

    def __init__(self, flags: list[bool] | None = None) -> None:
        self._flags = flags if flags is not None else []

    @property
    def after_lead(self) -> bool:
        return bool(self._flags) and self._flags[-1]

    def accept(self, guard: SurrogateGuard, token_id: int) -> None:
        self._flags.append(self.after_lead if token_id in guard.empty else token_id in guard.ends_in_lead)

    def rollback(self, num_tokens: int) -> None:
        del self._flags[len(self._flags) - min(num_tokens, len(self._flags)):]

    def fork(self) -> LeadState:
        return LeadState(list(self._flags))
