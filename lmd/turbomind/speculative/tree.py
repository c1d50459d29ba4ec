"""Token trees (SpecInfer): several proposals verified in one target forward, and which path of them is kept.

A tree hangs below the sequence's last known token, the root. Its nodes are listed parents first (`parents[i] < i`,
-1 for a child of the root); in the verification chunk the root is row 0 and node i row 1 + i, at position
`root_position + depth(i)`, and each row attends to the cached prefix, its ancestors and itself only (`row_masks`:
bit j of row r set when chunk row j is visible to it). Row r's logits are the target's distribution after the path
to r, so they judge the children of r.

Acceptance walks from the root down:
  - greedy (`greedy_path`): go to the child whose token is the row's argmax while there is one; the argmax of the
    last row reached is the bonus token. The kept tokens are plain greedy decoding's, whatever else the tree holds.
  - sampled (`sampled_path`, SpecInfer's multi-step speculative sampling): at row r with target distribution p, the
    children's tokens (drawn i.i.d. from the draft's q at r, repeats allowed: a repeat is a trial of the same node)
    are tried in order: accept child x with probability min(1, p(x) / q(x)) and continue from it; else
    p <- norm(max(0, p - q)) and try the next; when all are rejected, the token is drawn from the last p. An n-gram
    tree's children are point masses, where q is the one-hot of the child tried. The kept tokens are distributed
    exactly as plain sampling's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from lmd.errors import LmdError

MAX_TREE_ROWS = 64  # root + nodes: one int64 visibility mask per row


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # -1: a child of the root

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise LmdError(f"a token tree needs one parent per token; got {len(self.tokens)} and {len(self.parents)}")
        if any(not -1 <= parent < i for i, parent in enumerate(self.parents)):
            raise LmdError(f"token tree parents {self.parents}: each must be -1 or an earlier node")
        if len(self.tokens) + 1 > MAX_TREE_ROWS:
            raise LmdError(f"a token tree of {len(self.tokens)} nodes: at most {MAX_TREE_ROWS - 1}")

    @classmethod
    def from_chains(cls, chains: list[list[int]]) -> TokenTree:
        """The trie of several proposed continuations (shared prefixes become one path), in order of appearance."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}
        for chain in chains:
            parent = -1
            for token in chain:
                node = children.get((parent, token))
                if node is None:
                    node = children[(parent, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                parent = node
        return cls(tuple(tokens), tuple(parents))

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """1 for a child of the root."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of each chunk row (row 0 the root, row 1 + i node i), as node indices, in order."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            out[parent + 1].append(i)
        return tuple(tuple(c) for c in out)

    def row_masks(self) -> list[int]:
        """Per chunk row, the bits of the chunk rows it attends to (the root, its ancestors, itself), as int64 values
        (bit 63 is the sign: a 64-row tree's last row is negative)."""
        masks = [1]
        for i, parent in enumerate(self.parents):
            masks.append(masks[parent + 1] | 1 << (i + 1))
        return [m - (1 << 64) if m >> 63 else m for m in masks]

    def positions(self, root_position: int) -> list[int]:
        return [root_position] + [root_position + d for d in self.depths]

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


def greedy_path(tree: TokenTree, argmax: list[int]) -> tuple[list[int], int]:
    """(nodes kept, bonus token) from each chunk row's argmax (target tokens, row 0 the root's)."""
    kept, row = [], 0
    while True:
        token = argmax[row]
        child = next((c for c in tree.children[row] if tree.tokens[c] == token), None)
        if child is None:
            return kept, token
        kept.append(child)
        row = child + 1


def sampled_path(tree: TokenTree, p: torch.Tensor, q: Callable[[int], torch.Tensor] | None,
                 trials: Callable[[int], list[int]], uniform: Callable[[], float],
                 draw: Callable[[torch.Tensor], int]) -> tuple[list[int], int]:
    """(nodes kept, the token drawn after them) by the rule of the module docstring. p: [rows, vocab] target
    distributions per chunk row; q(row): the draft's distribution the children of `row` were drawn from (None: an
    n-gram tree, point masses); trials(row): the children's nodes in the order drawn, repeats included; uniform():
    one number in [0, 1); draw(probs): one token from unnormalised probabilities."""
    kept, row = [], 0
    while True:
        target = p[row]
        accepted = None
        for node in trials(row):
            token = tree.tokens[node]
            proposal = torch.nn.functional.one_hot(torch.tensor(token), target.shape[0]).to(target) \
                if q is None else q(row)
            ratio = float(target[token]) / max(float(proposal[token]), torch.finfo(target.dtype).tiny)
            if uniform() < ratio:
                accepted = node
                break
            residual = (target - proposal).clamp_min(0)
            mass = float(residual.sum())
            if mass > 0:  # 0 by rounding only: a rejection needs p(x) < q(x)
                target = residual / mass
        if accepted is None:
            return kept, draw(target)
        kept.append(accepted)
        row = accepted + 1


def draft_tree(candidates: list[list[int]]) -> tuple[TokenTree, dict[int, list[int]], dict[int, int]]:
    """The tree of a draft chain with its candidates per depth (the chain's token first; only it is expanded):
    the tree, each expanded row's children in the order drawn (repeats kept: `sampled_path`'s trials), and the
    depth index of each expanded row (which of the chain's q judged its children)."""
    tokens: list[int] = []
    parents: list[int] = []
    trials: dict[int, list[int]] = {}
    depth_of: dict[int, int] = {}
    parent = -1
    for depth, drawn in enumerate(candidates):
        nodes: dict[int, int] = {}
        for token in drawn:
            if token not in nodes:
                nodes[token] = len(tokens)
                tokens.append(token)
                parents.append(parent)
        trials[parent + 1] = [nodes[t] for t in drawn]
        depth_of[parent + 1] = depth
        parent = nodes[drawn[0]]
    return TokenTree(tuple(tokens), tuple(parents)), trials, depth_of


def prefix(tree: TokenTree, nodes: int) -> TokenTree:
    """The first `nodes` nodes (the scheduler may cut a chunk's proposals short): still a tree, parents first."""
    return tree if nodes >= len(tree) else TokenTree(tree.tokens[:nodes], tree.parents[:nodes])


@dataclass
class TreeProposal:
    tree: TokenTree
    trials: dict[int, list[int]] | None = None  # a draft tree's children per row in the order drawn; None: in order
    depth_of: dict[int, int] | None = None  # a draft tree's expanded rows -> their depth (index of q)
    q: torch.Tensor | None = None  # [depth, vocab]: a sampled draft tree's distributions
    kept: list[int] | None = None  # set by tree_verify.choose: the nodes of the path kept

    def cut(self, nodes: int) -> None:
        self.tree = prefix(self.tree, nodes)
        if self.trials is not None:
            self.trials = {row: [n for n in order if n < nodes] for row, order in self.trials.items() if row <= nodes}
