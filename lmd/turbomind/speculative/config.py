"""`SpeculativeConfig`: how the engine proposes tokens that the target model verifies in one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

from lmd.errors import LmdError

METHODS = ("ngram", "draft")
DEFAULT_K = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: `ngram` (prompt lookup: the continuation of the latest earlier occurrence of the last n tokens, n from
    prompt_lookup_max down to prompt_lookup_min) or `draft` (a smaller workspace sharing the tokenizer);
    num_speculative_tokens: K, the most tokens proposed per step (a verification computes K + 1 positions);
    tree: (branch, depth) of a token tree (draft: branch candidates per depth; ngram: up to branch matches, each
    depth tokens), None for a chain; its depth is the proposal length."""

    method: str = "ngram"
    num_speculative_tokens: int = DEFAULT_K
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
        if self.method == "ngram" and self.model is not None:
            raise LmdError("--speculative-model needs --speculative-method draft")
        if self.method == "draft" and self.model is None:
            raise LmdError("--speculative-method draft needs --speculative-model WORKSPACE")
        if self.tree is not None and (len(self.tree) != 2 or min(self.tree) < 1):
            raise LmdError(f"--speculative-tree {self.tree}: give BRANCHxDEPTH with both >= 1, e.g. 2x4")
        if self.tree is not None and self.num_speculative_tokens != self.tree[1]:
            # a tree's depth is its proposal length (the K of a chain): the default K follows the tree
            if self.num_speculative_tokens != DEFAULT_K:
                raise LmdError(f"--num-speculative-tokens {self.num_speculative_tokens} and --speculative-tree "
                               f"{self.tree[0]}x{self.tree[1]}: a tree's depth is its proposal length; drop one or "
                               "make them equal")
            object.__setattr__(self, "num_speculative_tokens", self.tree[1])
        if self.tree is not None and self.tree[0] * self.tree[1] + 1 > 64:
            raise LmdError(f"--speculative-tree {self.tree[0]}x{self.tree[1]}: at most 63 tree tokens (BRANCH x "
                           "DEPTH); use a smaller tree")


def parse_tree(text: str) -> tuple[int, int]:
    """'2x4' -> (2, 4): two branches per depth, four depths."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise LmdError(f"--speculative-tree {text!r}: use BRANCHxDEPTH, e.g. 2x4")
    return int(parts[0]), int(parts[1])
