"""--refine-scale: each (row, group)'s grid fitted to the input Gram matrix never does worse than min-max/clip."""

from __future__ import annotations

import torch

from lmd.lite.awq_refine import group_grams, refine_grid
from lmd.lite.quantizer import MAX_CODE, quantize_weight


def _inputs(tokens: int, width: int, seed: int) -> torch.Tensor:
    """Correlated inputs with unequal channel magnitudes, like a transformer's."""
    generator = torch.Generator().manual_seed(seed)
    mix = torch.eye(width) + 0.3 * torch.randn(width, width, generator=generator)
    return torch.randn(tokens, width, generator=generator) @ mix * (0.2 + 3 * torch.rand(width, generator=generator))


def _group_errors(w: torch.Tensor, deq: torch.Tensor, x: torch.Tensor, g: int) -> torch.Tensor:
    """Mean over tokens of each (row, group)'s squared partial-output error, by re-running the tokens."""
    out, inp = w.shape
    d, xg = (deq - w).view(out, inp // g, g), x.view(-1, inp // g, g)
    return torch.einsum("ogk,tgk->otg", d, xg).pow(2).mean(1)


def test_group_grams_are_the_diagonal_blocks():
    h = torch.arange(64 * 64, dtype=torch.float32).view(64, 64)
    blocks = group_grams(h, 16)
    assert blocks.shape == (4, 16, 16)
    for i in range(4):
        assert torch.equal(blocks[i], h[16 * i : 16 * (i + 1), 16 * i : 16 * (i + 1)])


def test_refined_grid_never_increases_the_output_error_and_keeps_the_format():
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=generator) * 0.02
    w[:, 5] *= 6
    x = _inputs(1024, 128, seed=1)
    clipped = torch.clamp(w, -0.04, 0.04)  # stands in for the clip search's result
    start = quantize_weight(clipped, 32)
    refined = refine_grid(w, start, group_grams(x.T @ x / x.shape[0], 32))
    before = _group_errors(w, start.dequantize(), x, 32)
    after = _group_errors(w, refined.dequantize(), x, 32)
    assert (after <= before * (1 + 1e-5) + 1e-12).all()
    assert after.sum() < 0.95 * before.sum()  # after/before over 10 seeds: 0.03..0.45
    assert refined.scales.dtype == torch.float16 and refined.zeros.dtype == torch.uint8
    assert int(refined.zeros.max()) <= MAX_CODE and int(refined.codes.max()) <= MAX_CODE
    assert (refined.scales != start.scales).any() and (refined.scales > 0).all()


def test_with_identity_gram_the_refined_grid_fits_the_weights_in_plain_least_squares():
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=generator)
    start = quantize_weight(w, 64)
    refined = refine_grid(w, start, torch.eye(64).unsqueeze(0))
    err = lambda q: (q.dequantize() - w).pow(2).sum(1)  # noqa: E731
    assert (err(refined) <= err(start) + 1e-6).all() and err(refined).sum() < err(start).sum()
