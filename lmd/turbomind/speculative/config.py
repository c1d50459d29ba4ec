"""`SpeculativeConfig`: how the engine proposes tokens that the target model verifies in one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

from lmd.errors import LmdError

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: `ngram` (prompt lookup: the continuation of the latest earlier occurrence of the last n tokens, n from
    prompt_lookup_max down to prompt_lookup_min) or `draft` (a smaller workspace sharing the tokenizer);
    num_speculative_tokens: K, the most tokens proposed per step (a verification computes K + 1 positions);
    tree: (branch, depth) of a draft token tree, None for a chain."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None
    tree: tuple[int, int] | None = None
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise LmdError(f"speculative method {self.method!r} is unknown; use ngram or draft")
        if self.num_speculative_tokens < 1:
            raise LmdError(f"--num-speculative-tokens {self.num_speculative_tokens} must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise LmdError(f"prompt lookup n-gram sizes {self.prompt_lookup_min}..{self.prompt_lookup_max}: "
                           "need 1 <= min <= max")
        if self.method == "ngram" and (self.model is not None or self.tree is not None):
            raise LmdError("--speculative-model and --speculative-tree need --speculative-method draft")
        if self.method == "draft" and self.model is None:
            raise LmdError("--speculative-method draft needs --speculative-model WORKSPACE")
        if self.tree is not None and (len(self.tree) != 2 or min(self.tree) < 1):
            raise LmdError(f"--speculative-tree {self.tree}: give BRANCHxDEPTH with both >= 1, e.g. 2x4")


def parse_tree(text: str) -> tuple[int, int]:
    """'2x4' -> (2, 4): two branches per depth, four depths."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise LmdError(f"--speculative-tree {text!r}: use BRANCHxDEPTH, e.g. 2x4")
    return int(parts[0]), int(parts[1])
