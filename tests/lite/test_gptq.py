"""GPTQ error feedback on a fixed AWQ grid: lower output error than round-to-nearest, same format, error path."""

from __future__ import annotations

import pytest
import torch

from lmd.errors import LmdError
from lmd.lite.gptq import gptq_quantize
from lmd.lite.quantizer import quantize_weight, quantize_with_params
from tests.lite.test_awq_refine import _inputs


def _output_error(w: torch.Tensor, deq: torch.Tensor, x: torch.Tensor) -> float:
    return float((x @ (deq - w).T).pow(2).mean())


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_round_to_nearest_on_held_out_inputs(act_order):
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=generator) * 0.02
    tokens = _inputs(2560, 128, seed=1)
    calib, held_out = tokens[:2048], tokens[2048:]  # held-out tokens: not seen by the Hessian
    grid = quantize_weight(w, 32)
    q = gptq_quantize(w, calib.T @ calib / calib.shape[0], grid, act_order=act_order, block_size=48)
    assert torch.equal(q.scales, grid.scales) and torch.equal(q.zeros, grid.zeros)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
    # gptq/rtn over 10 seeds: 0.55..0.62 (act_order 0.36..0.39); bound 0.8 (1.3x); no error feedback gives 1.0
    assert _output_error(w, q.dequantize(), held_out) < 0.8 * _output_error(w, grid.dequantize(), held_out)


def test_uncorrelated_inputs_give_round_to_nearest_on_the_grid():
    """With a diagonal Hessian no error is fed forward: GPTQ's codes are the grid's nearest codes."""
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=generator)
    grid = quantize_weight(torch.clamp(w, -1.5, 1.5), 32)  # a clipped grid: some weights saturate
    q = gptq_quantize(w, torch.diag(torch.rand(64, generator=generator) + 0.5), grid)
    assert torch.equal(q.codes, quantize_with_params(w, grid.scales, grid.zeros, 32).codes)


def test_dead_inputs_get_the_zero_code():
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(4))
    h = torch.eye(32)
    h[7, 7] = 0.0  # an input channel that is always zero
    grid = quantize_weight(w, 32)
    q = gptq_quantize(w, h, grid)
    assert torch.equal(q.codes[:, 7], grid.zeros[:, 0])


def test_a_hessian_that_is_not_positive_definite_is_an_error():
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(5))
    with pytest.raises(LmdError, match="not positive definite.*--calib-samples"):
        gptq_quantize(w, -torch.eye(32), quantize_weight(w, 32))
