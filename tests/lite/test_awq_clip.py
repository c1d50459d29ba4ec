from __future__ import annotations

import torch

from lmd.lite.awq_clip import N_GRID, SHRINK_STEPS, apply_clip, apply_clip_range, search_clip, search_clip_asymmetric
from lmd.lite.quantizer import fake_quantize_groups
from tests.lite.test_awq_refine import _group_errors


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


def test_asymmetric_clip_is_the_best_pair_and_never_worse_than_symmetric():
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=generator) * 0.02
    w[:, 3] *= 8
    w[:, 70] += 0.05  # one-sided outliers: only the top of those groups' range should shrink
    x = torch.randn(256, 128, generator=generator)
    low, high = search_clip_asymmetric(w, x, 32)
    assert low.shape == high.shape == (64, 4)
    wg = w.view(64, 4, 32)

    def error(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        clipped = torch.clamp(wg, lo.unsqueeze(-1), hi.unsqueeze(-1))
        return _group_errors(w, fake_quantize_groups(clipped).view(64, 128), x, 32)

    best = error(low, high)
    for top in range(SHRINK_STEPS):  # brute force over the same grid, re-running the tokens
        for bottom in range(SHRINK_STEPS):
            hi = wg.amax(-1) * (1 - top / N_GRID)
            lo = torch.minimum(wg.amin(-1) * (1 - bottom / N_GRID), hi)
            assert (best <= error(lo, hi) * (1 + 1e-4) + 1e-12).all()
    limit = search_clip(w, x, 32)
    assert (best <= error(-limit, limit) * (1 + 1e-4) + 1e-12).all()
    assert (low > wg.amin(-1)).any() and (high < wg.amax(-1)).any() and (low != -high).any()


def test_apply_clip_range_clamps_each_group_to_its_own_low_and_high():
    lin = torch.nn.Linear(64, 1, bias=False)
    lin.weight.data = torch.linspace(-1, 1, 64).view(1, 64)
    apply_clip_range(lin, torch.tensor([[-0.5, -2.0]]), torch.tensor([[2.0, 0.25]]), 32)
    w = lin.weight.detach().view(2, 32)
    assert float(w[0].min()) == -0.5 and float(w[0].max()) == float(torch.linspace(-1, 1, 64)[31])
    assert float(w[1].max()) == 0.25 and float(w[1].min()) == float(torch.linspace(-1, 1, 64)[32])
