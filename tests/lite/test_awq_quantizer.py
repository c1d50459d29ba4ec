from __future__ import annotations

import pytest
import torch

from lmd.lite.awq_export import dequantize_gemm, gemm_tensors
from lmd.lite.quantizer import QuantizedWeight, fake_quantize, quantize_weight
from lmd.turbomind.kernels.w4a16_layout import AWQ_ORDER


def _weight(out: int = 64, inp: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("group_size", [128, 64, 32])
def test_quantize_dequantize_equals_fake_quantize(group_size):
    w = _weight()
    q = quantize_weight(w, group_size)
    assert q.codes.shape == w.shape and q.scales.shape == (64, 256 // group_size)
    assert q.codes.max() <= 15 and q.zeros.max() <= 15 and q.scales.dtype == torch.float16
    torch.testing.assert_close(q.dequantize(), fake_quantize(w, group_size), rtol=0, atol=0)


def test_fake_quantize_is_asymmetric_min_max_per_group():
    w = _weight(8, 64)
    deq = fake_quantize(w, 32)
    grouped, deq_g = w.view(8, 2, 32), deq.view(8, 2, 32)
    step = (grouped.amax(-1) - grouped.amin(-1)) / 15
    # the integer zero point shifts the grid by < half a step, so the error stays below one step (half inside)
    err = (deq_g - grouped).abs() / step.unsqueeze(-1)
    assert err.max() <= 1.0 + 1e-3 and err.median() < 0.5
    # every group uses only 16 distinct levels spanning roughly its range
    assert all(len(torch.unique(deq_g[r, g])) <= 16 for r in range(8) for g in range(2))


def test_constant_group_does_not_divide_by_zero():
    w = torch.zeros(8, 32)
    assert torch.equal(fake_quantize(w, 32), w)


def test_gemm_bit_layout_matches_a_hand_made_autoawq_example():
    # One input row, eight output columns holding codes 0..7; AutoAWQ puts column AWQ_ORDER[i] into nibble i.
    codes = torch.arange(8, dtype=torch.uint8).view(8, 1)  # W [out=8, in=1] -> W.T row [0..7]
    q = QuantizedWeight(codes=codes.expand(8, 32).contiguous(), zeros=torch.full((8, 1), 3, dtype=torch.uint8),
                        scales=torch.full((8, 1), 0.5, dtype=torch.float16), group_size=32)
    tensors = gemm_tensors(q)
    assert tensors["qweight"].shape == (32, 1) and tensors["qweight"].dtype == torch.int32
    expected = sum(AWQ_ORDER[i] << (4 * i) for i in range(8))  # columns 0,2,4,6,1,3,5,7 -> 0x75316420
    assert expected == 0x75316420
    assert int(tensors["qweight"][0, 0]) == expected
    assert int(tensors["qzeros"][0, 0]) == 0x33333333
    assert tensors["scales"].shape == (1, 8) and tensors["scales"].dtype == torch.float16


@pytest.mark.parametrize("group_size", [128, 32])
def test_gemm_tensors_round_trip_to_the_fake_quantized_weight(group_size):
    w = _weight(48, 256, seed=3)
    q = quantize_weight(w, group_size)
    t = gemm_tensors(q)
    assert t["qweight"].shape == (256, 6) and t["qzeros"].shape == (256 // group_size, 6)
    assert t["scales"].shape == (256 // group_size, 48)
    torch.testing.assert_close(dequantize_gemm(t["qweight"], t["qzeros"], t["scales"]), fake_quantize(w, group_size),
                               rtol=0, atol=0)
