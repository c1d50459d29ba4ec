"""Each W4A16 Triton path (Triton's CPU interpreter, small shapes) against the fp32 reference x @ dequant(W).T."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.turbomind.kernels.interpret_cases import CASES  # noqa: E402
from tests.turbomind.kernels.interpreter import run_interpreted  # noqa: E402

TOL = 3e-3  # fp16 weights and outputs: rounding alone gives ~5e-4


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """All cases in one fresh process: TRITON_INTERPRET must be set before Triton decorates the kernels."""
    return run_interpreted(Path(__file__).with_name("interpret_cases.py"))


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_path_matches_reference(interpreted: dict, name: str) -> None:
    err = interpreted[name]
    assert isinstance(err, float), err
    assert err < TOL, f"{name}: relative error {err:.2e}"


def test_dequant_kernel_is_exact(interpreted: dict) -> None:
    assert interpreted["dequant-kernel"] == 0.0


def test_split_k_workspace_cleans_itself(interpreted: dict) -> None:
    assert interpreted["workspace_clean"] is True


@pytest.mark.parametrize("block_k, k", [(48, 96), (64, 80)])
def test_frag_decode_rejects_k_outside_blocks_of_32(block_k: int, k: int) -> None:
    import torch

    from lmd.turbomind.kernels.w4a16_gemm_wt import WtGemmConfig, gemm_wt

    x = torch.randn(2, k, dtype=torch.float16)
    qweight = torch.zeros(k // 8, 64, dtype=torch.int32)
    scales = torch.ones(1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="multiples of 32"):
        gemm_wt(x, qweight, scales, -8 * scales, None, WtGemmConfig(64, 16, block_k, decode="frag"))


def test_frag_k_order_puts_each_k_where_the_fragment_reads_it() -> None:
    import torch

    from lmd.turbomind.kernels.w4a16_gemm_wt import frag_k_order

    x = torch.arange(2 * 64, dtype=torch.float32).view(2, 64)
    kp = torch.arange(64)
    # kp = 32 kc + 16 a + 8 b + 2 t + c holds k = 32 kc + 8 t + 4 c + 2 a + b
    k = (kp // 32) * 32 + 8 * ((kp // 2) % 4) + 4 * (kp % 2) + 2 * ((kp // 16) % 2) + (kp // 8) % 2
    assert torch.equal(frag_k_order(x), x[:, k])
    assert sorted(k.tolist()) == list(range(64))
