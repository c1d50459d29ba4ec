"""A token tree's verification rows: each row's sampling context (the path to it), and the path kept, decided when
the step's samples are made (greedy: the rows' argmax; sampled: SpecInfer's rule, `tree.sampled_path`).

Each row's chosen token (what its logprobs describe) is the next token of the kept path on the path's rows and the
row's argmax elsewhere (unused): `Speculator.accept` then takes the path's rows as a chain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmd.turbomind.sampler import Sampler, SamplingRow, draw, sampling_probs
from lmd.turbomind.speculative.tree import TokenTree, TreeProposal, greedy_path, sampled_path

if TYPE_CHECKING:
    from lmd.turbomind.request_state import RequestState


def tree_rows(state: RequestState, tree: TokenTree) -> list[SamplingRow]:
    """Row 0 (the root) sees the known tokens, row 1 + i also the path to node i (penalties, min_new_tokens)."""
    return [state.sampling_row()] + [state.sampling_row(tuple(tree.tokens[n] for n in tree.path(i)))
                                     for i in range(len(tree))]


def choose(sampler: Sampler, raw: torch.Tensor, rows: list[SamplingRow], proposal: TreeProposal) -> list[int]:
    """The tree rows' chosen tokens (module docstring); sets proposal.kept."""
    tree = proposal.tree
    argmax = sampler.choose(raw, rows).tolist() if rows[0].config.is_greedy else raw.argmax(dim=-1).tolist()
    if rows[0].config.is_greedy:
        proposal.kept, _ = greedy_path(tree, argmax)
        return argmax
    p = sampling_probs(raw, rows)
    device = raw.device
    q, trials, depth_of = proposal.q, proposal.trials, proposal.depth_of
    kept, token = sampled_path(
        tree, p, None if q is None else (lambda row: q[depth_of[row]].to(device)),  # type: ignore[index]
        (lambda row: list(tree.children[row])) if trials is None else (lambda row: trials.get(row, [])),
        lambda: float(sampler.uniforms(rows[:1], device)[0, 0]),
        lambda probs: int(draw(probs[None], sampler.uniforms(rows[:1], device))[0]))
    proposal.kept = kept
    path_rows = [0] + [n + 1 for n in kept]
    for row, next_token in zip(path_rows, [tree.tokens[n] for n in kept] + [token], strict=True):
        argmax[row] = next_token
    return argmax
