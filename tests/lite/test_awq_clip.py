from __future__ import annotations

import torch

from lmd.lite.awq_clip import N_GRID, SHRINK_STEPS, apply_clip, search_clip
from lmd.lite.quantizer import fake_quantize_groups


def _brute_force(w: torch.Tensor, x: torch.Tensor, g: int) -> torch.Tensor:
    """Re-run the tokens for every candidate, as AutoAWQ does: per (row, group) MSE of the partial outputs."""
    out, inp = w.shape
    wg, xg = w.view(out, inp // g, g), x.view(-1, inp // g, g)
    reference = torch.einsum("ogk,tgk->otg", wg, xg)
    absmax = wg.abs().amax(-1)
    best_err, best = torch.full_like(absmax, float("inf")), absmax.clone()
    for step in range(SHRINK_STEPS):
        limit = absmax * (1 - step / N_GRID)
        q = fake_quantize_groups(torch.clamp(wg, -limit.unsqueeze(-1), limit.unsqueeze(-1)))
        err = (torch.einsum("ogk,tgk->otg", q, xg) - reference).pow(2).mean(1)
        better = err < best_err
        best_err, best = torch.where(better, err, best_err), torch.where(better, limit, best)
    return best


def test_gram_matrix_search_matches_rerunning_the_tokens():
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=generator) * 0.02
    w[:, 3] *= 8  # a heavy input channel makes clipping worthwhile in some groups
    x = torch.randn(256, 128, generator=generator)
    got = search_clip(w, x, 32)
    assert got.shape == (96, 4)
    assert torch.equal(got, _brute_force(w, x, 32))
    assert (got < w.view(96, 4, 32).abs().amax(-1)).any()  # some groups were actually clipped


def test_apply_clip_clamps_each_group_to_its_limit():
    lin = torch.nn.Linear(64, 2, bias=False)
    lin.weight.data = torch.linspace(-1, 1, 128).view(2, 64)
    apply_clip(lin, torch.tensor([[0.5, 0.25], [1.0, 0.1]]), 32)
    w = lin.weight.view(2, 2, 32)
    assert w[0, 0].abs().max() <= 0.5 and w[0, 1].abs().max() <= 0.25 and w[1, 1].abs().max() <= 0.1
