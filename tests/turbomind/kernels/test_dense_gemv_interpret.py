"""The skinny dense GEMM (`kernels/dense_gemv.py`) under Triton's CPU interpreter against F.linear: M of 1 to 8,
K not a multiple of the block, N not a multiple of the rows per program, with and without bias, fp32 and fp16."""

from __future__ import annotations

import json
import sys

import pytest

from tests.turbomind.kernels.interpreter import run_interpreted, run_jobs

CASES = [(m, n, k, dtype, bias) for m, n, k, dtype, bias in (
    (1, 37, 300, "fp32", False), (3, 64, 257, "fp16", True), (8, 10, 64, "fp16", False), (5, 33, 1030, "fp32", True))]


def _case(m: int, n: int, k: int, dtype: str, bias: bool) -> float:
    import torch
    import torch.nn.functional as F

    from lmd.turbomind.kernels.dense_gemv import DenseGemvConfig, dense_gemv

    dt = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dt)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dt)
    b = torch.randn(n, generator=g).to(dt) if bias else None
    # prefetch: the PDL-only L2 hint is not run here (compiled in test_pdl_prefetch_compile.py), its pointers are
    out = dense_gemv(x, w, b, DenseGemvConfig(block_n=4, block_k=128, num_warps=2, num_stages=1, prefetch=int(bias)))
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_linear(results, case):
    error = results["-".join(map(str, case))]
    assert isinstance(error, float), error
    assert error < (1e-6 if case[3] == "fp32" else 2e-3)  # fp16: one rounding of the output


if __name__ == "__main__":
    sys.stdout.write(json.dumps(run_jobs({"-".join(map(str, c)): (lambda c=c: _case(*c)) for c in CASES})))
