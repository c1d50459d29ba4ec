"""Which kernel a dense fp16/bf16 linear runs for a few token rows (decode batches): a skinny GEMM in one of a few
configs, or cuBLAS — whichever is faster on this GPU for this (rows bucket, N, K, dtype), timed once (`tune`) and
kept on disk beside the W4A16 plans (`w4a16_plan_cache`, the same key scheme).

Buckets: 1 row runs the CUDA-core GEMV (`dense_gemv`); 2-8, 9-16, 17-32 and 33-64 rows the tensor-core kernel
(`dense_mma`), each planned at its largest row count (cuBLAS picks other kernels for fewer rows, so one bucket's
verdict does not carry to the next). Measured on an H200 (docs/benchmarks.md): at 1 row the GEMV streams the
Llama-7B/8B decode weights at 3.8-4.7 TB/s where cuBLAS reaches 3.3-4.2 (benchmarks/dense_gemv_probe.py); at 16
rows the tensor-core kernel is 1.02-1.12x cuBLAS on every decode linear, at 64 rows 1.09-1.16x on the down
projections and level or behind elsewhere, at 256 rows 0.72-0.94x (benchmarks/dense_mma_probe.py), so more rows
stay with cuBLAS. The candidates are the configs that came first or close on some shape of those probes (the
descriptor-fed ones, `tma`, from the eighteenth session's; a config a GPU cannot compile is skipped), and twins of
the leading ones that prefetch their first weight tiles into L2 before the PDL wait (`prefetch`, pdl.py): the
planner's timing, each call behind a PDL kernel, is where that overlap shows.
`LMD_DENSE_GEMV=0` keeps cuBLAS everywhere.
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
from lmd.turbomind.kernels.dense_mma import DenseMmaConfig, dense_mma
from lmd.turbomind.kernels.gpu_timing import cold_copies, graph_call_ms

log = logging.getLogger("lmd.kernels")

Config = DenseGemvConfig | DenseMmaConfig
_FEW_ROWS = tuple(DenseMmaConfig(*c) for c in (
    (64, 128, 4, 4, 1), (64, 128, 4, 4, 2), (64, 64, 4, 5, 4),
    (64, 128, 4, 5, 2, True), (64, 128, 4, 3, 4, True), (64, 64, 4, 6, 1, True), (128, 64, 4, 4, 1, True),
    (64, 128, 4, 5, 2, True, 2), (64, 64, 4, 6, 1, True, 4)))
# (block_n, block_k, warps, stages[, prefetch]) of the GEMV; (block_n, block_k, warps, stages, split_k, tma[,
# prefetch]) of the MMA kernel
CANDIDATES: dict[int, tuple[Config, ...]] = {
    1: tuple(DenseGemvConfig(n, k, 2, *rest) for n, k, *rest in (
        (4, 1024, 2), (4, 1024, 3), (4, 1024, 4), (4, 512, 3), (4, 512, 4), (2, 1024, 3), (2, 1024, 4), (8, 512, 4),
        (4, 1024, 3, 1), (4, 512, 4, 2))),
    **{rows: _FEW_ROWS for rows in (8, 16, 32)},
    64: tuple(DenseMmaConfig(*c) for c in (
        (64, 128, 4, 4, 2), (128, 64, 8, 3, 1), (64, 128, 4, 5, 2, True), (64, 128, 4, 6, 1, True),
        (128, 64, 4, 3, 1, True), (64, 128, 4, 5, 2, True, 2), (64, 128, 4, 6, 1, True, 2))),
}
# a skinny GEMM must beat cuBLAS by 1.5 %, more than the graph timing's noise, to be chosen. At 3 % the planner
# flipped between runs on the 7B w13 at 64 rows and kept cuBLAS for qkv (lmd ahead by 2.7-3.1 % and 2.0-2.5 % in
# three calls); on one machine the batch-64 step replayed 5.90 ms with lmd's w13 against 5.94 with cuBLAS's
# (docs/benchmarks.md, twentieth session)
MARGIN = 0.985


def bucket_of(rows: int) -> int | None:
    """The planned bucket that `rows` token rows run with; None: cuBLAS."""
    return next((b for b in CANDIDATES if rows <= b), None)


@dataclass(frozen=True)
class CublasPlan:
    """F.linear was as fast: keep it."""


_KINDS = {"DenseGemvConfig": DenseGemvConfig, "DenseMmaConfig": DenseMmaConfig, "CublasPlan": CublasPlan}
_PLANS: dict[tuple[int, int, int, torch.dtype, str], Config | None] = {}
# (rows bucket, N, K, dtype name) -> {"cublas" or a config's name: ms}, for the weights tuned in this process
TUNE_LOG: dict[tuple[int, int, int, str], dict[str, float]] = {}


def enabled() -> bool:
    return os.environ.get("LMD_DENSE_GEMV", "1") != "0" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def run_planned(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: Config) -> torch.Tensor:
    if isinstance(config, DenseGemvConfig):
        return dense_gemv(x, weight, bias, config)
    return dense_mma(x, weight, bias, config)


def plans_for(weight: torch.Tensor) -> dict[int, Config]:
    """bucket -> the config its rows run with, for the buckets where a skinny GEMM beats cuBLAS on this weight
    (empty on CPU, fp32, or when none does)."""
    if weight.device.type != "cuda" or weight.dtype not in (torch.float16, torch.bfloat16) or not enabled():
        return {}
    if weight.dim() != 2 or weight.stride(1) != 1:
        return {}
    out = {}
    for bucket in CANDIDATES:
        plan = _plan(weight, bucket)
        if plan is not None:
            out[bucket] = plan
    return out


def _plan(weight: torch.Tensor, rows: int) -> Config | None:
    n, k = weight.shape
    key = (rows, n, k, weight.dtype, str(weight.device))
    if key in _PLANS:
        return _PLANS[key]
    gpu = torch.cuda.get_device_name(weight.device)
    dtype = str(weight.dtype).removeprefix("torch.")
    names = ["cublas"] + [c.name() for c in CANDIDATES[rows]]
    fingerprint = plan_cache.candidates_fingerprint(names)
    disk_key = plan_cache.cache_key(gpu, rows, n, k, 0, f"{dtype} dense graph-timed", fingerprint)
    plan = plan_cache.plan_from_json(plan_cache.load().get(disk_key, {}), _KINDS) if plan_cache.enabled() else None
    if plan is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        with torch.cuda.device(weight.device):  # the timing's streams, events and graphs live on the weight's GPU
            plan = tune(weight, rows)
        if plan_cache.enabled():
            plan_cache.store(disk_key, plan)
    _PLANS[key] = None if isinstance(plan, CublasPlan) else plan
    return _PLANS[key]


def tune(weight: torch.Tensor, rows: int) -> Config | CublasPlan:
    """Time cuBLAS and every candidate of the bucket on `weight` with `rows` random rows; the fastest (candidates
    must be right). Timed as a decode step runs them (`graph_call_ms`): each call behind an RMSNorm kernel, as a
    projection follows its norm, so the candidates' early start under programmatic dependent launch counts (cuBLAS
    launches without it), on weight copies worth more than L2."""
    from lmd.turbomind.kernels.rms_norm import add_rms_norm_triton
    from lmd.turbomind.kernels.w4a16 import output_is_wrong

    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    ref = F.linear(x.float(), weight.float())
    norm_weight = torch.ones(weight.shape[1], dtype=weight.dtype, device=weight.device)
    weights = [w for (w,) in cold_copies((weight,))]

    def timed(run) -> float:
        return graph_call_ms(lambda w: run(x, w), weights, lambda: add_rms_norm_triton(x, None, norm_weight, 1e-6))

    cublas_ms = timed(F.linear)
    log_entry = TUNE_LOG.setdefault((rows, *weight.shape, str(weight.dtype).removeprefix("torch.")), {})
    log_entry["cublas"] = cublas_ms
    best: tuple[float, Config] | None = None
    for config in CANDIDATES[rows]:
        with contextlib.suppress(Exception):  # a config the compiler rejects is not a candidate
            if output_is_wrong(run_planned(x, weight, None, config), ref):
                log.warning("dense %s gives wrong output for %s; not a candidate", config.name(), tuple(weight.shape))
                continue
            ms = log_entry[config.name()] = timed(lambda xs, w, c=config: run_planned(xs, w, None, c))
            if best is None or ms < best[0]:
                best = (ms, config)
    if best is None or best[0] >= MARGIN * cublas_ms:
        return CublasPlan()
    return best[1]
