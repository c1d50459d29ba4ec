"""The W8A8 Triton kernels (per-token quantization, scaled GEMM) and their dispatch under Triton's CPU interpreter,
against the PyTorch references, in fp32 and fp16.

All cases run in one fresh process (this file run as a script, TRITON_INTERPRET=1 set before Triton decorates the
kernels); the script prints one JSON object, case name -> result (or the exception text).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.turbomind.kernels.interpreter import run_jobs

QDTYPES = ("int8", "fp8")
ACT = ("fp32", "fp16")


def _dtypes(q: str, act: str):
    import torch

    return ({"int8": torch.int8, "fp8": torch.float8_e4m3fn}[q], {"fp32": torch.float32, "fp16": torch.float16}[act])


def quant_case(q: str, act: str, k: int) -> dict[str, float]:
    """Codes equal to the reference's but for values within an fp32 rounding of a rounding boundary, which may land on
    the neighbouring code (one int8 step, one e4m3 grid step)."""
    import torch

    from lmd.turbomind.kernels.w8a8_quant import quantize_per_token_triton
    from lmd.turbomind.kernels.w8a8_reference import quantize_per_token_reference

    qdtype, dtype = _dtypes(q, act)
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(9, k + 8, generator=g) * 3)[:, 4 : 4 + k].to(dtype)  # strided rows
    x[2] = 0  # an all-zero token
    x[3, 7] = 90.0  # an outlier
    codes, scales = quantize_per_token_triton(x.contiguous(), qdtype)
    ref_codes, ref_scales = quantize_per_token_reference(x, qdtype)
    diff = (codes.float() - ref_codes.float()).abs()
    step = ref_codes.float().abs().clamp(min=2**-6) / 8 if q == "fp8" else torch.ones_like(diff)
    return {"scales": (scales - ref_scales).abs().max().item(), "mismatch": (diff > 0).float().mean().item(),
            "steps": (diff / step).max().item(), "zero_row": codes[2].float().abs().max().item()}


def gemm_case(q: str, act: str, m: int, n: int, k: int, bias: bool) -> float:
    import torch

    from lmd.turbomind.kernels.w8a8_gemm import scaled_mm_triton
    from lmd.turbomind.kernels.w8a8_reference import (
        quantize_per_token_reference,
        quantize_weight_per_channel,
        scaled_mm_reference,
    )

    qdtype, dtype = _dtypes(q, act)
    g = torch.Generator().manual_seed(m * n + k)
    codes, scale = quantize_per_token_reference(torch.randn(m, k, generator=g), qdtype)
    weight, w_scale = quantize_weight_per_channel(torch.randn(n, k, generator=g), qdtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = scaled_mm_triton(codes, scale, weight, w_scale, b, dtype)
    ref = scaled_mm_reference(codes, scale, weight, w_scale, b, dtype)
    assert out.shape == (m, n) and out.dtype == dtype
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def dispatch_case(q: str, act: str) -> float:
    """w8a8_linear with LMD_W8A8_OPS=triton vs =reference on a 3-D activation."""
    import torch

    from lmd.turbomind.kernels.w8a8_reference import quantize_weight_per_channel
    from lmd.turbomind.linear import w8a8_linear

    qdtype, dtype = _dtypes(q, act)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 7, 96, generator=g).to(dtype)
    weight, w_scale = quantize_weight_per_channel(torch.randn(40, 96, generator=g), qdtype)
    os.environ["LMD_W8A8_OPS"] = "triton"
    out = w8a8_linear(x, weight, w_scale)
    os.environ["LMD_W8A8_OPS"] = "reference"
    ref = w8a8_linear(x, weight, w_scale)
    assert out.shape == (2, 7, 40)
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def plan_case(q: str, bucket: int) -> float:
    """Every Triton candidate of a plan bucket (`w8a8_plan.candidates`) against the reference, fp16 out: the largest
    relative error over them."""
    import torch

    from lmd.turbomind.kernels.w8a8_plan import Tiles, candidates, run_plan
    from lmd.turbomind.kernels.w8a8_reference import (
        quantize_per_token_reference,
        quantize_weight_per_channel,
        scaled_mm_reference,
    )

    qdtype, _ = _dtypes(q, "fp16")
    g = torch.Generator().manual_seed(bucket)
    codes, scale = quantize_per_token_reference(torch.randn(21, 80, generator=g), qdtype)
    weight, w_scale = quantize_weight_per_channel(torch.randn(40, 80, generator=g), qdtype)
    ref = scaled_mm_reference(codes, scale, weight, w_scale, None, torch.float16).float()
    worst = 0.0
    for plan in candidates(bucket):
        if isinstance(plan, Tiles):
            out = run_plan(plan, codes, scale, weight, w_scale, None, torch.float16).float()
            worst = max(worst, ((out - ref).abs().max() / ref.abs().max()).item())
    return worst


def tune_case() -> dict[str, str]:
    """`w8a8_plan.tune` with a stub timer: the fastest candidate whose output is right wins; a faster one whose output
    is wrong (corrupted here) is passed over."""
    import torch

    from lmd.turbomind.kernels import w8a8_plan
    from lmd.turbomind.kernels.w8a8_reference import quantize_weight_per_channel

    weight, w_scale = quantize_weight_per_channel(torch.randn(40, 80, generator=torch.Generator().manual_seed(1)),
                                                  torch.int8)
    tiles = [c for c in w8a8_plan.candidates(64) if isinstance(c, w8a8_plan.Tiles)]
    wrong, fastest_right = tiles[0], tiles[1]
    ms = {wrong: 1.0, fastest_right: 2.0} | {t: 3.0 + i for i, t in enumerate(tiles[2:])}
    ran = []
    real_run = w8a8_plan.run_plan

    def run_plan(plan, *args):  # noqa: ANN001, ANN202 - the stub's signature is run_plan's
        ran.append(plan)
        out = real_run(plan, *args)
        return out * 2 if plan == wrong else out

    def timer(fn, flush):  # noqa: ANN001, ANN202
        fn()
        return ms.get(ran[-1], 100.0)  # a torch plan, where this torch runs it, comes last

    w8a8_plan.run_plan = run_plan
    try:
        chosen = w8a8_plan.tune(weight, w_scale, torch.float16, 64, timer=timer)
    finally:
        w8a8_plan.run_plan = real_run
    return {"chosen": repr(chosen), "expected": repr(fastest_right)}


QUANT_CASES = {f"quant-{q}-{a}-k{k}": (q, a, k) for q in QDTYPES for a in ACT for k in (96, 5000)}
GEMM_CASES = {f"gemm-{q}-{a}-m{m}-n{n}-k{k}-{'bias' if b else 'nobias'}": (q, a, m, n, k, b)
              for q in QDTYPES for a in ACT for m, n, k, b in ((1, 70, 100, True), (19, 33, 64, False))}
DISPATCH_CASES = {f"dispatch-{q}-{a}": (q, a) for q in QDTYPES for a in ACT}
PLAN_CASES = {f"plan-{q}-m{b}": (q, b) for q in QDTYPES for b in (16, 64, 256, 1024, 4096)}
ULP = {"fp32": 1e-6, "fp16": 1e-3}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    jobs = {**{n: (lambda a=a: quant_case(*a)) for n, a in QUANT_CASES.items()},
            **{n: (lambda a=a: gemm_case(*a)) for n, a in GEMM_CASES.items()},
            **{n: (lambda a=a: dispatch_case(*a)) for n, a in DISPATCH_CASES.items()},
            **{n: (lambda a=a: plan_case(*a)) for n, a in PLAN_CASES.items()},
            "tune": tune_case}
    json.dump(run_jobs(jobs), sys.stdout)


if __name__ == "__main__":
    main()


@pytest.fixture(scope="module")
def interpreted() -> dict:
    from tests.turbomind.kernels.interpreter import run_interpreted

    return run_interpreted(__file__)


@pytest.mark.parametrize("name", QUANT_CASES)
def test_per_token_quantization_matches_reference(interpreted: dict, name: str) -> None:
    result = interpreted[name]
    assert isinstance(result, dict), result
    assert result["scales"] == 0.0, f"{name}: scales differ by {result['scales']:.2e} (same operations expected)"
    assert result["steps"] <= 1.0 and result["mismatch"] < 1e-3, f"{name}: {result}"
    assert result["zero_row"] == 0.0


@pytest.mark.parametrize("name", GEMM_CASES)
def test_scaled_gemm_matches_reference(interpreted: dict, name: str) -> None:
    err = interpreted[name]
    assert isinstance(err, float), err
    assert err < ULP[GEMM_CASES[name][1]], f"{name}: off by {err:.2e}"


@pytest.mark.parametrize("name", DISPATCH_CASES)
def test_dispatch_runs_the_kernels_like_the_reference(interpreted: dict, name: str) -> None:
    err = interpreted[name]
    assert isinstance(err, float), err
    # a code one step off (see quant_case) moves an output by up to one step x |weight| x scales
    assert err < 2e-2 if DISPATCH_CASES[name][0] == "fp8" else err < 1e-2, f"{name}: off by {err:.2e}"


@pytest.mark.parametrize("name", PLAN_CASES)
def test_every_planned_tile_config_matches_reference(interpreted: dict, name: str) -> None:
    err = interpreted[name]
    assert isinstance(err, float), err
    assert err < ULP["fp16"], f"{name}: off by {err:.2e}"


def test_tune_picks_the_fastest_right_candidate(interpreted: dict) -> None:
    result = interpreted["tune"]
    assert isinstance(result, dict), result
    assert result["chosen"] == result["expected"]


def test_plan_buckets_and_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from lmd.errors import LmdError
    from lmd.turbomind.kernels import w8a8_plan

    assert [w8a8_plan.bucket_of(m) for m in (1, 16, 17, 64, 65, 300, 1024, 1025, 9000)] == [
        16, 16, 64, 64, 256, 1024, 1024, 4096, 4096]
    assert not any(isinstance(c, w8a8_plan.TorchPlan) for c in w8a8_plan.candidates(16))  # torch needs > 16 rows
    assert all(isinstance(w8a8_plan.candidates(b)[-1], w8a8_plan.TorchPlan) for b in (64, 256, 1024, 4096))
    weight = torch.zeros(8, 16, dtype=torch.int8)
    assert w8a8_plan.plans_for(weight, torch.ones(8), torch.float16) == {}  # CPU: nothing to time
    monkeypatch.setenv("LMD_W8A8_GEMM", "cublas")
    with pytest.raises(LmdError, match="LMD_W8A8_GEMM='cublas'"):
        w8a8_plan.gemm_choice()


def test_fp8_candidates_are_checked_with_fast_accumulation_bounds() -> None:
    """An e4m3 GEMM 1 % off (sm_90's fast accumulation is ~0.4 %) is a candidate; int8 (exact int32 sums) is not,
    and 10 % off is wrong for both."""
    import torch

    from lmd.turbomind.kernels.w8a8_plan import _wrong

    ref = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    for off, fp8_wrong, int8_wrong in ((0.01, False, True), (0.1, True, True)):
        y = (ref * (1 + off)).half()
        assert _wrong(y, ref, torch.float8_e4m3fn) is fp8_wrong
        assert _wrong(y, ref, torch.int8) is int8_wrong
