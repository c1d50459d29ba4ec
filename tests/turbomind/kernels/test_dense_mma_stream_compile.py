"""The stream-K skinny GEMM (`kernels/dense_mma_stream.py`) compiled here for sm_90 (Triton's NVIDIA backend, no
GPU): its loop must stay software-pipelined — a ring of `num_stages` tensor-descriptor buffers in shared memory —
with the tile fixup (atomics, partial loads) kept out of it; put into the loop, Triton compiles it with a single
buffer and every key tile waits on its copy. Also: the weight prefetch comes before the PDL wait."""

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

INTS = ("M", "N", "K", "total", "k_steps", "programs", "stride_xm", "stride_wn", "stride_ym")


def _compile(block_m: int, block_n: int, block_k: int, stages: int, prefetch: int):
    from lmd.turbomind.kernels.dense_mma_stream import _dense_mma_stream_kernel

    sig = {"x_desc": f"tensordesc<fp16[{block_m}, {block_k}]>", "w_desc": f"tensordesc<fp16[{block_n}, {block_k}]>",
           "x_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16", "y_ptr": "*fp16", "slots_ptr": "*fp32",
           "counts_ptr": "*i32", **dict.fromkeys(INTS, "i32")}
    consts = {"HAS_BIAS": True, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "MAX_PARTS": 3,
              "DESC": True, "PREFETCH": prefetch, "PF_LINES": max(1, prefetch * block_k // 64), "LINE": 64,
              "USE_PDL": True}
    src = ASTSource(fn=_dense_mma_stream_kernel, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                    constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages})


@pytest.mark.parametrize(("block_m", "stages"), [(64, 4), (16, 6)])
def test_loop_is_pipelined(block_m: int, stages: int) -> None:
    compiled = _compile(block_m, 64, 128, stages, prefetch=0)
    stage_bytes = (block_m + 64) * 128 * 2  # an x tile and a weight tile, fp16
    assert compiled.metadata.shared >= stages * stage_bytes, compiled.metadata.shared
    assert "warp_group_dot" in compiled.asm["ttgir"]  # Hopper's MMA, operands from the ring


def test_prefetch_before_the_wait() -> None:
    lines = [line.strip() for line in _compile(64, 64, 128, 4, prefetch=2).asm["ptx"].splitlines()]
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    prefetches = [i for i, line in enumerate(lines) if "prefetch.global.L2" in line]
    assert len(waits) == 1 and prefetches and max(prefetches) < waits[0]
