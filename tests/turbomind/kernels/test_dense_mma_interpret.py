"""The tensor-core skinny GEMM (`kernels/dense_mma.py`) under Triton's CPU interpreter against F.linear: M of 2 to
40 (padded to the MMA's 16-row granule and beyond), K not a multiple of the key tile, N not a multiple of the column
tile, split-K 1 to 3 (the last split shorter), with and without bias, fp32 and fp16; the pointer kernel and the one
fed by tensor descriptors (`tma`, tiles past the edges zero-filled). Split-K joins in the kernel (the last split of a
column tile sums the partials); with more column tiles than counters a second kernel sums them, to the same bits."""

from __future__ import annotations

import json
import sys

import pytest

from tests.turbomind.kernels.interpreter import run_interpreted, run_jobs

CASES = [(m, n, k, split, dtype, bias, tma) for m, n, k, split, dtype, bias in (
    (2, 70, 200, 1, "fp32", False), (16, 64, 257, 2, "fp16", True), (5, 33, 300, 3, "fp16", False),
    (40, 96, 130, 2, "fp32", True)) for tma in (False, True)]
# a descriptor needs 16-byte rows: K = 257 / 300 / 130 fp16 or fp32 rows are not, so those run the pointer kernel
CASES += [(3, 72, 264, 3, "fp16", True, True), (20, 40, 200, 1, "fp32", False, True)]


def _case(m: int, n: int, k: int, split: int, dtype: str, bias: bool, tma: bool) -> float:
    import torch
    import torch.nn.functional as F

    from lmd.turbomind.kernels.dense_mma import DenseMmaConfig, dense_mma

    dt = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dt)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dt)
    b = torch.randn(n, generator=g).to(dt) if bias else None
    config = DenseMmaConfig(block_n=32, block_k=64, num_warps=4, num_stages=1, split_k=split, tma=tma,
                            prefetch=2 * bias)  # the PDL-only prefetch is not run here, its pointers are
    out = dense_mma(x, w, b, config)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def _join_matches_split_sum(tma: bool) -> bool:
    """The in-kernel join and the split-sum kernel give the same bits; the counters are zero again after a join."""
    import torch

    from lmd.turbomind.kernels import dense_mma as dm

    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 320, generator=g).half()
    w = (torch.randn(96, 320, generator=g) * 0.05).half()
    b = torch.randn(96, generator=g).half()
    config = dm.DenseMmaConfig(block_n=32, block_k=64, num_warps=4, num_stages=1, split_k=3, tma=tma)
    joined = dm.dense_mma(x, w, b, config)
    counters_zero = not dm._join_counters(x.device).any().item()
    limit, dm.MAX_JOIN_TILES = dm.MAX_JOIN_TILES, 0
    try:
        summed = dm.dense_mma(x, w, b, config)
    finally:
        dm.MAX_JOIN_TILES = limit
    return counters_zero and torch.equal(joined, summed)


@pytest.mark.parametrize("tma", (False, True))
def test_join_matches_split_sum(results, tma):
    assert results[f"join-{tma}"] is True


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_linear(results, case):
    error = results["-".join(map(str, case))]
    assert isinstance(error, float), error
    # fp32: tl.dot may run in tf32 on a GPU but not in the interpreter; fp16: one rounding of the output
    assert error < (1e-5 if case[4] == "fp32" else 2e-3)


def test_row_buckets():
    from lmd.turbomind.kernels.dense_gemv_plan import bucket_of

    assert [bucket_of(m) for m in (1, 2, 8, 9, 16, 17, 33, 64, 65, 256)] == [1, 8, 8, 16, 16, 32, 64, 64, None, None]


if __name__ == "__main__":
    jobs = {"-".join(map(str, c)): (lambda c=c: _case(*c)) for c in CASES}
    jobs |= {f"join-{tma}": (lambda tma=tma: _join_matches_split_sum(tma)) for tma in (False, True)}
    sys.stdout.write(json.dumps(run_jobs(jobs)))
