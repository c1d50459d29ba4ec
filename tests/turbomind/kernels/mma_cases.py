"""What the tests of the CUDA mma.sync W4A16 kernels share: engine-layout weights to run them on, and the tuner's
limits on a row's error (`w4a16.output_is_wrong`, spelled out so that these tests need no Triton)."""

from __future__ import annotations

import torch

from lmd.turbomind.kernels.w4a16_layout import quantize_to_engine, w4a16_matmul_reference

DTYPES = (torch.float16, torch.bfloat16)
ROW_LIMIT = {torch.float16: 3e-3, torch.bfloat16: 2.5e-2}


def engine_weights(n: int, k: int, group: int, dtype: torch.dtype, seed: int = 0):
    """(qweight, scales, zeros) of a random [n, k] weight quantized to the engine layout."""
    gen = torch.Generator().manual_seed(seed)
    return quantize_to_engine(torch.randn(n, k, generator=gen) * 0.02, group, dtype)


def row_errors(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each row's norm-wise error relative to the reference row."""
    return (y.float() - ref).norm(dim=1) / ref.norm(dim=1)


def lane_case(n: int, k: int, group: int, m: int, dtype: torch.dtype):
    """(qweight, scales, zeros, x, bias, the fp32 reference output with bias) for one lane-emulation case."""
    qweight, scales, zeros = engine_weights(n, k, group, dtype, seed=n + m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, dtype=dtype, generator=gen)
    bias = torch.randn(n, dtype=dtype, generator=gen)
    ref = w4a16_matmul_reference(x.float(), qweight, scales, zeros).float() + bias.float()
    return qweight, scales, zeros, x, bias, ref
