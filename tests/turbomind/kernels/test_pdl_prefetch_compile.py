"""The weight prefetch before the PDL wait (`pdl.pdl_prologue_prefetching`), compiled here for sm_90 (Triton's own
ptxas, no GPU): the interpreter never runs it (PDL is off there), so these tests read the PTX of the three kernels
that take it. With PREFETCH the kernel issues `prefetch.global.L2` for its first weight tiles, every one before
`griddepcontrol.wait`; without it, none. The GPU timing is the planner's (`dense_gemv_plan.tune`)."""

from __future__ import annotations

import os

import pytest
import triton
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1" or "nvidia" not in backends,
                                 reason="compiles for sm_90 with Triton's NVIDIA backend"),
              pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")]

MMA_PARAMS = {"HAS_BIAS": False, "PARTIAL": True, "JOIN": True, "SPLIT_K": 2, "BLOCK_M": 16, "BLOCK_N": 64,
              "BLOCK_K": 128, "USE_PDL": True}
INTS = ("M", "N", "K", "k_per_split")


def _ptx_lines(fn, signature: dict[str, str], constexprs: dict[str, object], warps: int = 4) -> list[str]:
    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
    return [line.strip() for line in compiled.asm["ptx"].splitlines()]


def _prefetches_before_wait(lines: list[str]) -> tuple[int, bool]:
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    prefetches = [i for i, line in enumerate(lines) if "prefetch.global.L2" in line]
    assert len(waits) == 1, waits
    return len(prefetches), all(i < waits[0] for i in prefetches)


def _mma(tma: bool, prefetch: int) -> list[str]:
    from lmd.turbomind.kernels import dense_mma

    lines = max(1, prefetch * MMA_PARAMS["BLOCK_K"] // 64)
    consts = {**MMA_PARAMS, "PREFETCH": prefetch, "PF_LINES": lines, "LINE": 64}
    if tma:
        sig = {"x_desc": "tensordesc<fp16[16, 128]>", "w_desc": "tensordesc<fp16[64, 128]>", "w_ptr": "*fp16",
               "b_ptr": "*fp16", "y_ptr": "*fp16", "part_ptr": "*fp32", "cnt_ptr": "*i32", **dict.fromkeys(INTS, "i32"),
               "stride_wn": "i32", "stride_ym": "i32"}
        return _ptx_lines(dense_mma._dense_mma_tma_kernel, sig, consts)
    sig = {"x_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16", "y_ptr": "*fp16", "part_ptr": "*fp32",
           "cnt_ptr": "*i32", **dict.fromkeys(INTS, "i32"), "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"}
    return _ptx_lines(dense_mma._dense_mma_kernel, sig, consts)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
def test_dense_mma_prefetches_before_the_wait(tma: bool) -> None:
    count, ordered = _prefetches_before_wait(_mma(tma, prefetch=2))
    # 64 rows x 4 lines (2 tiles of 128 fp16 = 256 bytes) over 128 threads: 2 each
    assert count == 2 and ordered
    assert _prefetches_before_wait(_mma(tma, prefetch=0)) == (0, True)
    lines = _mma(tma, prefetch=0)
    if tma:
        assert any("cp.async.bulk.tensor" in line for line in lines)  # the copy engine
    # the split-K join: one counter add with acquire-release at GPU scope, one exchange back to zero
    assert sum("atom" in line and ".acq_rel" in line and ".gpu" in line and ".add" in line for line in lines) == 1
    assert sum("atom" in line and ".exch" in line for line in lines) == 1


def test_dense_gemv_prefetches_before_the_wait() -> None:
    from lmd.turbomind.kernels import dense_gemv

    def lines(prefetch: int) -> list[str]:
        consts = {"HAS_BIAS": False, "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 1024, "PREFETCH": prefetch,
                  "PF_LINES": max(1, prefetch * 1024 // 64), "LINE": 64, "USE_PDL": True}
        sig = {"x_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16", "y_ptr": "*fp16", "M": "i32", "N": "i32",
               "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"}
        return _ptx_lines(dense_gemv._dense_gemv_kernel, sig, consts, warps=2)

    count, ordered = _prefetches_before_wait(lines(1))
    assert count == 1 and ordered  # 4 rows x 16 lines (1024 fp16) over 64 threads
    assert _prefetches_before_wait(lines(0)) == (0, True)
