"""Which kernel a dense fp16/bf16 linear runs for one token row (batch-1 decode): the skinny GEMM (`dense_gemv`) in
one of a few configs, or cuBLAS — whichever is faster on this GPU for this (N, K, dtype), timed once on the layer's
own weight with cold L2 and kept on disk beside the W4A16 plans (`w4a16_plan_cache`, the same key scheme).

Measured on an H200 (benchmarks/dense_gemv_probe.py, docs/benchmarks.md): at M = 1 the skinny GEMM streams the
Llama-7B/8B decode weights at 3.8-4.7 TB/s where cuBLAS reaches 3.3-4.2; from M = 2 cuBLAS is as fast or faster, so
only M = 1 is planned. `LMD_DENSE_GEMV=0` keeps cuBLAS everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmd.turbomind.kernels import w4a16_plan_cache as plan_cache
from lmd.turbomind.kernels.dense_gemv import DenseGemvConfig, dense_gemv
from lmd.turbomind.kernels.gpu_timing import cold_call_ms

log = logging.getLogger("lmd.kernels")

# The configs that were fastest on some decode shape of the probe (block_n, block_k, warps, stages).
CANDIDATES = tuple(DenseGemvConfig(n, k, 2, s) for n, k, s in (
    (4, 1024, 2), (4, 1024, 3), (4, 1024, 4), (4, 512, 3), (4, 512, 4), (2, 1024, 3), (2, 1024, 4), (8, 512, 4)))
MARGIN = 0.97  # the skinny GEMM must beat cuBLAS by 3 %, more than the timing noise, to be chosen


@dataclass(frozen=True)
class CublasPlan:
    """F.linear was as fast: keep it."""


_KINDS = {"DenseGemvConfig": DenseGemvConfig, "CublasPlan": CublasPlan}
_PLANS: dict[tuple[int, int, torch.dtype, str], DenseGemvConfig | None] = {}


def enabled() -> bool:
    return os.environ.get("LMD_DENSE_GEMV", "1") != "0" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def gemv_plan(weight: torch.Tensor) -> DenseGemvConfig | None:
    """The config one-row inputs of this [N, K] weight run with, or None for cuBLAS (CPU, fp32, or not faster)."""
    if weight.device.type != "cuda" or weight.dtype not in (torch.float16, torch.bfloat16) or not enabled():
        return None
    if weight.dim() != 2 or weight.stride(1) != 1:
        return None
    n, k = weight.shape
    key = (n, k, weight.dtype, str(weight.device))
    if key in _PLANS:
        return _PLANS[key]
    gpu = torch.cuda.get_device_name(weight.device)
    dtype = str(weight.dtype).removeprefix("torch.")
    names = ["cublas"] + [c.name() for c in CANDIDATES]
    disk_key = plan_cache.cache_key(gpu, 1, n, k, 0, f"{dtype} dense", plan_cache.candidates_fingerprint(names))
    plan = plan_cache.plan_from_json(plan_cache.load().get(disk_key, {}), _KINDS) if plan_cache.enabled() else None
    if plan is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        plan = tune(weight)
        if plan_cache.enabled():
            plan_cache.store(disk_key, plan)
    _PLANS[key] = None if isinstance(plan, CublasPlan) else plan
    return _PLANS[key]


def tune(weight: torch.Tensor) -> DenseGemvConfig | CublasPlan:
    """Time cuBLAS and every candidate on `weight` with one random row; the fastest (candidates must be right)."""
    from lmd.turbomind.kernels.w4a16 import output_is_wrong

    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    ref = F.linear(x.float(), weight.float())
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=weight.device)
    cublas_ms = cold_call_ms(lambda: F.linear(x, weight), flush)
    best: tuple[float, DenseGemvConfig] | None = None
    for config in CANDIDATES:
        with contextlib.suppress(Exception):  # a config the compiler rejects is not a candidate
            if output_is_wrong(dense_gemv(x, weight, None, config), ref):
                log.warning("dense GEMV %s gives wrong output for %s; not a candidate", config.name(),
                            tuple(weight.shape))
                continue
            ms = cold_call_ms(lambda c=config: dense_gemv(x, weight, None, c), flush)
            if best is None or ms < best[0]:
                best = (ms, config)
    del flush
    if best is None or best[0] >= MARGIN * cublas_ms:
        return CublasPlan()
    return best[1]
