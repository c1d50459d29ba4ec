"""Which GEMM a W8A8 linear runs for M token rows: lmd's Triton scaled GEMM (`w8a8_gemm`) in one of a few tile
configs, or PyTorch's (`torch._scaled_mm`, cuBLASLt FP8 with row-wise scales; `torch._int_mm`, cuBLAS int8 with the
scales in a second pass) — whichever is fastest on this GPU for this (M bucket, N, K, 8-bit dtype, output dtype),
timed once per weight shape with cold L2 and kept on disk beside the W4A16 plans (`w4a16_plan_cache`'s key scheme).

Why a plan and not one rule: on the H200 (docs/benchmarks.md, issue 19) the Triton GEMM leads at 1-16 rows (1.35-
1.74x fp16 cuBLAS, where torch's GEMMs need more than 16 rows) and at 1024 rows on some shapes, while
`torch._scaled_mm` leads at 256 rows on the N = 4096 shapes (1.21-1.31x against 0.81-0.99x); tile choices move the
Triton figures by up to 30 % per shape.

Buckets 16, 64, 256, 1024, 4096: M rows run with the plan of the smallest bucket >= M (the largest one beyond it),
each timed at its own row count. `LMD_W8A8_GEMM` = auto (the plan, default) / triton (`tiles_for(M)` always) /
torch (PyTorch's GEMM wherever M > 16).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmd.errors import LmdError
from lmd.turbomind.kernels import w4a16_plan_cache as plan_cache
from lmd.turbomind.kernels.gpu_timing import cold_call_ms
from lmd.turbomind.kernels.w4a16 import WRONG_ELEMENT, WRONG_ROW, output_is_wrong
from lmd.turbomind.kernels.w8a8_gemm import Tiles, scaled_mm_triton, tiles_for
from lmd.turbomind.kernels.w8a8_reference import quantize_per_token_reference, scaled_mm_reference

log = logging.getLogger("lmd.kernels")

GEMM_ENV = "LMD_W8A8_GEMM"
BUCKETS = (16, 64, 256, 1024, 4096)
TORCH_MIN_ROWS = 17  # torch._scaled_mm / _int_mm want more rows than this (cuBLASLt's row-wise FP8, int8 alignment)
# (block_m, block_n, block_k, warps, stages): tiles_for(bucket) first, then shapes that led some linear in the
# ninth and twelfth sessions' sweeps (benchmarks/w8a8_gpu.py)
_EXTRA: dict[int, tuple[Tiles, ...]] = {
    16: (Tiles(16, 128, 128, 4, 4), Tiles(16, 32, 256, 4, 4)),
    64: (Tiles(32, 64, 256, 4, 4), Tiles(64, 128, 128, 4, 4), Tiles(64, 32, 256, 4, 4)),
    256: (Tiles(64, 128, 128, 4, 4), Tiles(128, 64, 128, 4, 4), Tiles(64, 64, 128, 4, 4), Tiles(128, 128, 64, 4, 4)),
    1024: (Tiles(128, 256, 128, 8, 3), Tiles(128, 128, 64, 4, 4), Tiles(128, 128, 128, 4, 4)),
    4096: (Tiles(128, 128, 128, 8, 3), Tiles(128, 256, 64, 8, 3)),
}


@dataclass(frozen=True)
class TorchPlan:
    """PyTorch's 8-bit GEMM was fastest."""


Plan = Tiles | TorchPlan
_KINDS = {"Tiles": Tiles, "TorchPlan": TorchPlan}
_PLANS: dict[tuple, Plan] = {}


def gemm_choice() -> str:
    choice = os.environ.get(GEMM_ENV) or "auto"
    if choice not in ("auto", "triton", "torch"):
        raise LmdError(f"{GEMM_ENV}={choice!r}: use 'auto' (the default), 'triton' or 'torch'")
    return choice


def bucket_of(rows: int) -> int:
    return next((b for b in BUCKETS if rows <= b), BUCKETS[-1])


def candidates(bucket: int) -> tuple[Plan, ...]:
    tiles = tuple(dict.fromkeys((tiles_for(bucket), *_EXTRA[bucket])))
    return tiles + ((TorchPlan(),) if bucket >= TORCH_MIN_ROWS else ())


def torch_gemm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's 8-bit GEMM with lmd's scales: q [M, K] codes, scale fp32 [M], weight [N, K], weight_scale fp32 [N]."""
    if q.dtype == torch.int8:
        y = torch._int_mm(q, weight.t()).float() * scale[:, None] * weight_scale[None, :]
        return (y if bias is None else y + bias.float()).to(out_dtype)
    return torch._scaled_mm(q, weight.t(), scale_a=scale[:, None], scale_b=weight_scale[None, :], bias=bias,
                            out_dtype=out_dtype)


def run_plan(plan: Plan, q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    if isinstance(plan, TorchPlan) and q.shape[0] >= TORCH_MIN_ROWS:
        return torch_gemm(q, scale, weight, weight_scale, bias, out_dtype)
    tiles = plan if isinstance(plan, Tiles) else None  # a torch plan's bucket met fewer rows: Triton's default
    return scaled_mm_triton(q, scale, weight, weight_scale, bias, out_dtype, tiles)


def gemm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
         bias: torch.Tensor | None, out_dtype: torch.dtype, plans: dict[int, Plan]) -> torch.Tensor:
    """The scaled GEMM as LMD_W8A8_GEMM says: the planned kernel of q's bucket (Triton's default tiles where none
    was planned), Triton's default tiles, or PyTorch's."""
    choice = gemm_choice()
    if choice == "torch" and q.is_cuda and q.shape[0] >= TORCH_MIN_ROWS:
        return torch_gemm(q, scale, weight, weight_scale, bias, out_dtype)
    plan = plans.get(bucket_of(q.shape[0])) if choice == "auto" else None
    if plan is None:
        return scaled_mm_triton(q, scale, weight, weight_scale, bias, out_dtype)
    return run_plan(plan, q, scale, weight, weight_scale, bias, out_dtype)


def plans_for(weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype) -> dict[int, Plan]:
    """bucket -> the fastest GEMM for this weight on this GPU (empty off CUDA, under the interpreter, or unless
    LMD_W8A8_GEMM is auto)."""
    if (weight.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or gemm_choice() != "auto"
            or out_dtype not in (torch.float16, torch.bfloat16)):
        return {}
    return {bucket: _plan(weight, weight_scale, out_dtype, bucket) for bucket in BUCKETS}


def _plan(weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype, bucket: int) -> Plan:
    n, k = weight.shape
    key = (bucket, n, k, weight.dtype, out_dtype, str(weight.device))
    if key in _PLANS:
        return _PLANS[key]
    gpu = torch.cuda.get_device_name(weight.device)
    dtypes = f"{str(weight.dtype).removeprefix('torch.')}>{str(out_dtype).removeprefix('torch.')} w8a8"
    names = [repr(c) for c in candidates(bucket)]
    disk_key = plan_cache.cache_key(gpu, bucket, n, k, 0, dtypes, plan_cache.candidates_fingerprint(names))
    plan = plan_cache.plan_from_json(plan_cache.load().get(disk_key, {}), _KINDS) if plan_cache.enabled() else None
    if plan is None:
        if torch.cuda.is_current_stream_capturing():
            return tiles_for(bucket)
        plan = tune(weight, weight_scale, out_dtype, bucket)
        if plan_cache.enabled():
            plan_cache.store(disk_key, plan)
    _PLANS[key] = plan
    return plan


def tune(weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype, rows: int,
         timer: Callable[[Callable[[], object], torch.Tensor], float] = cold_call_ms) -> Plan:
    """Time every candidate of the bucket on `weight` with `rows` random token rows (codes and scales as the
    per-token quantizer gives them); the fastest whose output is right. `timer(fn, flush)` -> ms."""
    g = torch.Generator(device=weight.device).manual_seed(rows)
    x = torch.randn(rows, weight.shape[1], device=weight.device, generator=g)
    q, scale = quantize_per_token_reference(x, weight.dtype)
    ref = scaled_mm_reference(q, scale, weight, weight_scale, None, torch.float32).float()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=weight.device)
    best: tuple[float, Plan] | None = None
    for plan in candidates(rows):
        with contextlib.suppress(Exception):  # a config the compiler rejects (or torch refuses) is not a candidate
            if _wrong(run_plan(plan, q, scale, weight, weight_scale, None, out_dtype), ref, weight.dtype):
                log.warning("w8a8 %s gives wrong output for %s; not a candidate", plan, tuple(weight.shape))
                continue
            ms = timer(lambda p=plan: run_plan(p, q, scale, weight, weight_scale, None, out_dtype), flush)
            if best is None or ms < best[0]:
                best = (ms, plan)
    del flush
    return tiles_for(rows) if best is None else best[1]


def _wrong(y: torch.Tensor, ref: torch.Tensor, qdtype: torch.dtype) -> bool:
    """The W4A16 tuner's check; FP8 with the bf16 bounds: Triton's e4m3 dots on sm_90 accumulate in the tensor
    cores' reduced precision (fast accumulation, as vLLM's CUTLASS FP8 kernels do), ~4e-3 of the largest output at
    K = 4096 and more at K = 11008, an order below e4m3's own rounding of the activations (~4 %). A broken config
    is off by O(1)."""
    if qdtype != torch.float8_e4m3fn or y.dtype == torch.bfloat16:
        return output_is_wrong(y, ref)
    row, element = WRONG_ROW[torch.bfloat16], WRONG_ELEMENT[torch.bfloat16]
    y = y.float()
    diff = y - ref
    return bool(not torch.isfinite(y).all() or (diff.norm(dim=1) > row * ref.norm(dim=1)).any()
                or (diff.abs() > element * ref.abs().amax(dim=1, keepdim=True)).any())
