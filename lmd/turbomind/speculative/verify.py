"""Which tokens a verification keeps when the request samples (temperature > 0): speculative sampling (Leviathan et
al. 2023, Chen et al. 2023), so the tokens are distributed exactly as plain sampling's.

For proposal x_j at row j, with p_j the target's distribution there (`sampler.sampling_probs`: penalties, bias,
temperature, top-k, min-p, top-p, as plain sampling draws) and q_j the proposer's:
  - accept x_j with probability min(1, p_j(x_j) / q_j(x_j));
  - else draw from norm(max(0, p_j - q_j)) and stop;
  - after the last proposal, draw the bonus token from p_k.
An n-gram proposal is a point mass q_j = delta(x_j): accepted with probability p_j(x_j), on rejection drawn from p_j
without x_j. A greedy request needs none of this (its p is one-hot: the plain argmax per row is the rule).

Every row gets its token in one vectorised pass: row j's is x_j if accepted, else its residual draw (never x_j: a
rejection means p_j(x_j) < q_j(x_j), so the residual is 0 there), the last row's its draw from p_k. The engine then
keeps the rows up to the first one whose token is not its proposal, as for greedy. Each row takes two uniforms from
the request's generator (the test, then the draw), whatever is accepted, so a seeded request repeats itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmd.turbomind.kernels.host_copy import to_device
from lmd.turbomind.sampler import Sampler, SamplingRow, draw, sampling_probs


@dataclass(frozen=True)
class SampledVerification:
    first_row: int  # of the verification's 1 + k rows in the step's sampled rows
    proposals: tuple[int, ...]
    draft_probs: torch.Tensor | None  # [k, vocab]: the draft's distributions the proposals came from; None: n-gram


def rejection_tokens(p: torch.Tensor, proposals: torch.Tensor, q: torch.Tensor, accept_u: torch.Tensor,
                     draw_u: torch.Tensor) -> torch.Tensor:
    """Each row's token by the rule above. p, q: [n, vocab] (q rows are 0 where the row has no proposal);
    proposals: [n] (-1: no proposal, the bonus row); accept_u, draw_u: [n, 1] uniforms in [0, 1)."""
    has = proposals >= 0
    index = proposals.clamp_min(0).unsqueeze(1)
    px, qx = p.gather(1, index).squeeze(1), q.gather(1, index).squeeze(1)
    ratio = torch.where(has & (qx > 0), px / qx.clamp_min(torch.finfo(q.dtype).tiny), torch.zeros_like(px))
    accepted = has & (accept_u.squeeze(1) < ratio)
    residual = (p - q).clamp_min(0)
    # p == q where it rejected cannot happen in exact arithmetic (a rejection needs p(x) < q(x)); rounding can
    # leave a row all 0, which then draws from p
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    return torch.where(accepted, proposals, draw(residual, draw_u))


def choose_with_verifications(sampler: Sampler, raw: torch.Tensor, rows: list[SamplingRow],
                              verifications: list[SampledVerification], skip: set[int]) -> torch.Tensor:
    """The step's tokens: verifications of sampled requests by rejection sampling, every other row (plain rows,
    greedy verifications) by the sampler; rows in `skip` (token trees: the caller's) are left 0."""
    device = raw.device
    chosen = torch.zeros(len(rows), dtype=torch.long, device=device)
    verified = [v.first_row + j for v in verifications for j in range(len(v.proposals) + 1)]
    taken = set(verified) | skip
    others = [i for i in range(len(rows)) if i not in taken]
    if len(others) == len(rows):
        return sampler.choose(raw, rows)
    if others:
        index = to_device(others, torch.int64, device)
        chosen[index] = sampler.choose(raw[index], [rows[i] for i in others])
    if not verified:
        return chosen
    index = to_device(verified, torch.int64, device)
    picked = [rows[i] for i in verified]
    p = sampling_probs(raw[index], picked)
    q = torch.zeros_like(p)
    proposals, start = [], 0
    for v in verifications:
        k = len(v.proposals)
        if v.draft_probs is None:
            q[torch.arange(start, start + k, device=device), to_device(list(v.proposals), torch.int64, device)] = 1.0
        else:
            q[start:start + k] = v.draft_probs[:k].to(device=device, dtype=q.dtype)
        proposals += [*v.proposals, -1]
        start += k + 1
    accept_u = sampler.uniforms(picked, device)
    draw_u = sampler.uniforms(picked, device)
    chosen[index] = rejection_tokens(p, to_device(proposals, torch.int64, device), q, accept_u, draw_u)
    return chosen
