"""cpu_linear: the CPU path of dense linears and the lm_head computes 2-3 token rows as (W @ x.T).T; every row count
gives F.linear's result (fp32 rounding), with and without bias, and other dtypes keep F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmd.turbomind.linear import CPU_SWAP_ROWS, cpu_linear


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(160, 96, generator=g)
    bias = torch.randn(160, generator=g) if with_bias else None
    y = cpu_linear(x, w, bias)
    assert y.shape == (rows, 160) and y.is_contiguous()  # heads are split out of it as views
    torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_swaps_only_fp32_rows_it_names():
    assert 2 in CPU_SWAP_ROWS and 1 not in CPU_SWAP_ROWS
    x, w = torch.randn(2, 32).half(), torch.randn(8, 32).half()
    assert torch.equal(cpu_linear(x, w), F.linear(x, w))  # fp16: F.linear itself
