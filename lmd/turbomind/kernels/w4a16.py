"""W4A16 linear: the one dispatch point the engine calls, y = x @ dequant(W).T (+ bias).

On CUDA tensors with Triton present (or under TRITON_INTERPRET=1) the token count M picks a plan per bucket
(M rounded up to a power of two); the candidates per bucket are
    M <= 4      -> split-K GEMV on CUDA cores          (w4a16_gemv)
    M <= 128    -> split-K tensor-core GEMM            (w4a16_gemm, SPLIT_K > 1; plain or nibble-dot)
    M >= 32     -> tiled tensor-core GEMM              (w4a16_gemm, SPLIT_K = 1)
    any M       -> transposed GEMM, weights as the MMA's register operand, split-K or tiled, PTX decode on CUDA,
                   nibbles decoded straight into the MMA fragment ("frag")
                                                       (w4a16_gemm_wt; the usual winner from M = 2 to 128)
    M >= 128    -> Triton dequant, then cuBLAS         (w4a16_dequant)
    M <= 16     -> warp-level mma.sync GEMV in CUDA C++ (NVRTC)  (w4a16_mma_gemv; up to 128 with LMD_W4A16_CUDA=1)
    M >= 16     -> warp-level mma.sync GEMM in CUDA C++, a cp.async pipeline through shared memory
                                                       (w4a16_mma_gemm; with LMD_W4A16_CUDA=1)
    M >= 64     -> warpgroup wgmma GEMM in CUDA C++ (sm_90a): TMA copies by a producer thread, two consumer
                   warpgroups dequantizing into registers (RS; SS: the producer dequantizes into shared memory)
                                                       (w4a16_wgmma; RS from M = 256, all with LMD_W4A16_CUDA=1)
                   (LMD_W4A16_CUDA=0 offers none of the CUDA kernels: w4a16_mma_gemv.cuda_kernels)
and the measured fastest wins (H200, H100: docs/benchmarks.md). fp16/bf16 activations; other dtypes, CPU tensors
and machines without Triton take the PyTorch reference. On a GPU the plan of each (bucket, N, K, group, dtype) is
autotuned once by timing the candidates and cached; `prewarm` does this for every bucket up to max_m, compiles the
kernels and grows the split-K workspace, so that a CUDA graph capture afterwards never tunes, compiles or allocates.
Tuned plans are also kept on disk per GPU (`w4a16_plan_cache`), so the next process skips the tuning, and lmd ships
the plans measured on some GPUs (`w4a16_shipped_plans`), so a first start there skips it too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import torch

from lmd.turbomind.kernels import w4a16_mma_gemm, w4a16_mma_gemv, w4a16_wgmma
from lmd.turbomind.kernels import w4a16_plan_cache as plan_cache
from lmd.turbomind.kernels import w4a16_shipped_plans as shipped_plans
from lmd.turbomind.kernels.w4a16_layout import w4a16_matmul_reference
from lmd.turbomind.kernels.w4a16_mma_gemm import MmaGemmConfig
from lmd.turbomind.kernels.w4a16_mma_gemv import MmaGemvConfig
from lmd.turbomind.kernels.w4a16_timer import candidate_timer, timer_suffix, tune_timer
from lmd.turbomind.kernels.w4a16_wgmma import WgmmaConfig

try:
    from lmd.turbomind.kernels.w4a16_dequant import DequantConfig, dequant_matmul
    from lmd.turbomind.kernels.w4a16_gemm import GemmConfig, gemm
    from lmd.turbomind.kernels.w4a16_gemm_wt import WtGemmConfig, gemm_wt
    from lmd.turbomind.kernels.w4a16_gemv import GemvConfig, gemv

    PLAN_KINDS: dict[str, type] = {t.__name__: t for t in (GemvConfig, GemmConfig, WtGemmConfig, DequantConfig,
                                                            MmaGemvConfig, MmaGemmConfig, WgmmaConfig)}
    HAS_TRITON = True
except ImportError:  # the engine still runs, on the reference path
    HAS_TRITON = False

log = logging.getLogger(__name__)
Plan = Union["GemvConfig", "GemmConfig", "WtGemmConfig", "DequantConfig", MmaGemvConfig, MmaGemmConfig,
             WgmmaConfig]
MAX_BUCKET = 4096


@dataclass(frozen=True)
class PlanKey:
    bucket: int
    n: int
    k: int
    group: int
    dtype: torch.dtype
    device: str


_PLANS: dict[PlanKey, Plan] = {}


def m_bucket(m: int) -> int:
    return min(1 << max(m - 1, 0).bit_length(), MAX_BUCKET)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_usable(x: torch.Tensor) -> bool:
    """The kernels take fp16/bf16 activations (tensor-core operands); other dtypes run the reference."""
    return HAS_TRITON and x.dtype in (torch.float16, torch.bfloat16) and (x.is_cuda or _interpreting())


def run_plan(plan: Plan, x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """Run one kernel path with a fixed config (the tests call this directly for every path)."""
    if isinstance(plan, GemvConfig):
        return gemv(x2d, qweight, scales, zeros, bias, plan)
    if isinstance(plan, GemmConfig):
        return gemm(x2d, qweight, scales, zeros, bias, plan)
    if isinstance(plan, WtGemmConfig):
        return gemm_wt(x2d, qweight, scales, zeros, bias, plan)
    if isinstance(plan, MmaGemvConfig):
        return w4a16_mma_gemv.mma_gemv(x2d, qweight, scales, zeros, bias, plan)
    if isinstance(plan, MmaGemmConfig):
        return w4a16_mma_gemm.mma_gemm(x2d, qweight, scales, zeros, bias, plan)
    if isinstance(plan, WgmmaConfig):
        return w4a16_wgmma.wgmma_gemm(x2d, qweight, scales, zeros, bias, plan)
    return dequant_matmul(x2d, qweight, scales, zeros, bias, plan)


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _split_for(tiles: int, k_steps: int, sms: int, per_sm: int = 2, min_steps: int = 2, cap: int = 32) -> int:
    """Smallest power-of-two split that puts about `per_sm` programs on every SM, keeping >= min_steps K steps each."""
    split = 1
    while tiles * split < per_sm * sms and k_steps // (split * 2) >= min_steps and split < cap:
        split *= 2
    return split


def _gemv(bucket: int, k: int, bn: int, bk8: int, warps: int, steps: int, stages: int = 1) -> GemvConfig:
    """A GEMV config whose programs each take about `steps` K steps (many short programs hide memory latency)."""
    return GemvConfig(bn, bk8, max(1, (k // (8 * bk8)) // steps), warps, stages, bucket)


def _splitk(bucket: int, n: int, k: int, sms: int, bn: int, bk: int, warps: int = 4, per_sm: int = 4,
            nibble_dots: bool = False) -> GemmConfig:
    bm = max(16, min(bucket, 64))
    tiles = -(-bucket // bm) * -(-n // bn)
    return GemmConfig(bm, bn, bk, _split_for(tiles, k // bk, sms, per_sm, 2, 16), 8, warps, 1, nibble_dots)


def _wt(bucket: int, n: int, k: int, sms: int, bn: int, bk: int, warps: int = 4, per_sm: int = 2, stages: int = 1,
        decode: str = "load", bm: int = 0) -> WtGemmConfig:
    bm = bm or max(16, min(bucket, 128))
    tiles = -(-bucket // bm) * -(-n // bn)
    return WtGemmConfig(bn, bm, bk, _split_for(tiles, k // bk, sms, per_sm, 2, 16), warps, stages, decode)


def default_plan(bucket: int, n: int, k: int, group: int, device: torch.device) -> Plan:
    """The untuned choice (interpreter, tuning off, or a CUDA graph capture that meets an unseen shape)."""
    sms = _sms(device)
    if bucket <= 4:
        return _gemv(bucket, k, 256, 2, 2, 2) if device.type == "cuda" else GemvConfig(128, 8, 2, 4, 1, bucket)
    if bucket <= 64:
        return _splitk(bucket, n, k, sms, 64, 64)
    if bucket <= 256 or device.type != "cuda":
        return GemmConfig(64, 64, 64, 1, 8, 4, 1)
    return DequantConfig()


def candidates(bucket: int, n: int, k: int, group: int, device: torch.device) -> list[Plan]:
    """Configs timed by the autotuner for one bucket; every one is valid for this N, K and group (the Triton ones for
    any)."""
    sms = _sms(device)
    out: list[Plan] = [default_plan(bucket, n, k, group, device)]
    if bucket == 1:
        for bn, bk8, warps in ((128, 1, 1), (128, 2, 1), (256, 1, 2), (256, 2, 2), (512, 1, 4), (512, 2, 4),
                               (256, 1, 1), (512, 1, 2), (512, 2, 2), (1024, 1, 4), (256, 4, 2)):
            for steps in (1, 2, 4):
                out.append(_gemv(bucket, k, bn, bk8, warps, steps))
        for bn, bk8, warps in ((128, 8, 1), (256, 8, 2), (128, 16, 1), (256, 4, 1), (512, 4, 2)):
            for steps in (1, 2, 4, 8):
                out.append(_gemv(bucket, k, bn, bk8, warps, steps))
        for bn, bk8, warps in ((1024, 1, 4), (1024, 2, 4), (512, 4, 2), (1024, 4, 4), (2048, 1, 8), (2048, 2, 8)):
            for steps in (1, 2, 4, 8):  # 8 columns per thread: x loads and conversions spread over more weights
                out.append(_gemv(bucket, k, bn, bk8, warps, steps))
        for bn, bk8, warps in ((512, 1, 2), (256, 2, 2), (1024, 1, 4), (512, 2, 4)):
            out.append(_gemv(bucket, k, bn, bk8, warps, max(1, group // (8 * bk8))))  # a group per program: one fold
        for bn, bk8, warps in ((512, 2, 2), (1024, 2, 4), (512, 2, 4), (256, 2, 2)):
            for steps in (3, 5, 6, 7):  # grids between the powers of two: a last wave of programs less ragged
                out.append(_gemv(bucket, k, bn, bk8, warps, steps))
    elif bucket <= 4:
        for bn, bk8, warps in ((128, 1, 1), (256, 1, 2), (512, 1, 2), (256, 2, 2), (128, 8, 1), (256, 4, 1),
                               (512, 2, 4), (1024, 1, 4), (512, 1, 4), (1024, 2, 4)):
            for steps in (1, 2, 4):
                out.append(_gemv(bucket, k, bn, bk8, warps, steps))
    if bucket <= 128:
        for bn, bk, warps in ((64, 64, 4), (32, 64, 4), (64, 128, 4), (128, 64, 4), (256, 64, 4), (128, 128, 8)):
            for per_sm in (2, 4, 8):
                out.append(_splitk(bucket, n, k, sms, bn, bk, warps, per_sm))
        for bn, bk, warps in ((64, 128, 4), (128, 128, 4), (64, 256, 4), (256, 128, 8), (32, 128, 4),
                              (128, 256, 4), (64, 512, 4)):
            for per_sm in (1, 2, 4, 8):
                out.append(_splitk(bucket, n, k, sms, bn, bk, warps, per_sm, nibble_dots=True))
    if bucket >= 32:
        for bm, bn, bk, warps in ((64, 32, 128, 4), (64, 64, 64, 4), (64, 64, 128, 8), (128, 64, 64, 4),
                                  (128, 64, 128, 8), (128, 128, 32, 8), (256, 64, 64, 4), (128, 32, 128, 4)):
            if bm <= max(bucket, 64):
                out.append(GemmConfig(bm, bn, bk, 1, 8, warps, 1))
        for bm, bn, bk, warps, stages in ((64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3),
                                          (128, 128, 64, 8, 3), (64, 64, 128, 4, 2)):
            if bm <= max(bucket, 64):
                out.append(GemmConfig(bm, bn, bk, 1, 8, warps, stages))
    decodes = ("asm", "frag")
    if bucket <= 64:
        for bn, bk, warps in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 4), (64, 256, 4), (128, 256, 8),
                              (32, 128, 4), (128, 128, 8)):
            out.append(_wt(bucket, n, k, sms, bn, bk, warps, 2, 1, "load"))
            for decode in decodes:
                out.append(_wt(bucket, n, k, sms, bn, bk, warps, 2, 1, decode))
                for per_sm in (1, 2, 4):
                    for stages in (2, 3, 4):
                        out.append(_wt(bucket, n, k, sms, bn, bk, warps, per_sm, stages, decode))
    if bucket <= 16:
        # splits between the powers of two: this tile fits 5 CTAs per SM, so a grid of 3-4 per SM can stay one wave
        # where split 4 spills into a second (measured: docs/benchmarks.md, sixth session)
        for split in (3, 5, 6):
            for stages in (3, 4):
                out.append(WtGemmConfig(64, 16, 128, split, 4, stages, "frag"))
    if bucket >= 32:
        # no 128x128x64 tile with 8 warps: on the H200 it returned wrong outputs at M >= 256 in some runs (a race;
        # docs/benchmarks.md, sixth session)
        for bn, bm, bk, warps, stages in ((128, 256, 64, 8, 3), (64, 128, 64, 4, 3),
                                          (64, 128, 64, 4, 4), (64, 128, 32, 4, 4), (64, 256, 64, 8, 3),
                                          (128, 128, 32, 4, 4), (64, 64, 64, 4, 3), (64, 64, 64, 4, 4),
                                          (128, 64, 64, 4, 4), (64, 128, 128, 4, 3)):
            if bm <= max(bucket, 64):
                for decode in ("interleave", *decodes, "frag-x"):
                    out.append(_wt(bucket, n, k, sms, bn, bk, warps, 1, stages, decode, bm))
        out.append(_wt(bucket, n, k, sms, 64, 128, 4, 1, 3, "load", min(128, max(bucket, 64))))
    if bucket >= 128:
        out.append(DequantConfig())
        out.append(DequantConfig(block_k8=8, block_n=256, num_warps=8))
    cuda = w4a16_mma_gemv.cuda_kernels(device)
    if cuda != "none":
        max_rows = w4a16_mma_gemv.MAX_ROWS if cuda == "all" else w4a16_mma_gemv.DEFAULT_ROWS
        out.extend(w4a16_mma_gemv.tuner_configs(bucket, n, k, group, max_rows, staged=cuda == "all"))
    if cuda == "all":
        out.extend(w4a16_mma_gemm.tuner_configs(bucket, n, k, group, sms))
    if cuda != "none" and w4a16_wgmma.runs_on(device):
        out.extend(w4a16_wgmma.offered_configs(bucket, n, k, group, every=cuda == "all"))
    return list(dict.fromkeys(out))


def compile_all(plans: list[Plan], x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor) -> None:
    """First launches on a thread pool: Triton's compiler (ptxas runs as a subprocess) then works in parallel."""
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    def first_run(plan: Plan) -> None:
        with contextlib.suppress(Exception):  # a failing config is judged again, serially, by the timing loop
            run_plan(plan, x, qweight, scales, zeros)

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(first_run, plans))
    torch.cuda.synchronize(qweight.device)


# Limits against the fp32 reference, about 10x what a correct path errs on random data (fp16: 2.9e-4 per row,
# norm-wise, and 4.5e-4 per element relative to its row's largest output; bf16: 2.3e-3 and 3.9e-3). Per row and per
# element, so that a few corrupted values (a race between tiles) are not averaged away over the whole output.
WRONG_ROW = {torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
WRONG_ELEMENT = {torch.float16: 5e-3, torch.bfloat16: 4e-2}


def output_is_wrong(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """y [M, N] (fp16/bf16) against the fp32 reference: not finite, a row further than WRONG_ROW (relative,
    norm-wise), or an element further than WRONG_ELEMENT of its row's largest output."""
    row_limit, element_limit = WRONG_ROW[y.dtype], WRONG_ELEMENT[y.dtype]
    y = y.float()
    if not bool(torch.isfinite(y).all()):
        return True
    diff = y - ref
    rows_off = diff.norm(dim=1) > row_limit * ref.norm(dim=1)
    elements_off = diff.abs() > element_limit * ref.abs().amax(dim=1, keepdim=True)
    return bool(rows_off.any() or elements_off.any())


def tune(bucket: int, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
         plans: list[Plan] | None = None) -> tuple[Plan, list[tuple[str, float]]]:
    """Time every candidate (`plans`, default `candidates`) at M = bucket on random activations, the way
    `LMD_W4A16_TIMER` says (`w4a16_timer`); returns the fastest and all timings (ms). A candidate whose output is
    wrong before or after its timing runs (`output_is_wrong`; the second check is there for races, which may show
    only in some runs) is dropped with a warning; if none is left, the untuned default plan is returned."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = k // scales.shape[0]
    x = torch.randn(bucket, k, dtype=dtype, device=qweight.device)
    ref = w4a16_matmul_reference(x.float(), qweight, scales, zeros)
    measure = candidate_timer(x, (qweight, scales, zeros), tune_timer())
    plans = plans if plans is not None else candidates(bucket, n, k, group, qweight.device)
    compile_all(plans, x, qweight, scales, zeros)
    timings: list[tuple[Plan, float]] = []
    failed: list[str] = []
    for plan in plans:
        try:
            before = run_plan(plan, x, qweight, scales, zeros)
            ms = measure(lambda q, s, z, p=plan: run_plan(p, x, q, s, z))
            after = run_plan(plan, x, qweight, scales, zeros)
        except Exception as exc:  # a config the compiler rejects (shared memory, registers) is not a candidate
            failed.append(f"{plan.name()}: {type(exc).__name__}")
            continue
        if output_is_wrong(before, ref) or output_is_wrong(after, ref):
            log.warning("W4A16 plan %s gives wrong output at M=%d N=%d K=%d; not a candidate", plan.name(), bucket,
                        n, k)
            continue
        timings.append((plan, ms))
    if failed:  # said, so that candidates lost to something else than the compiler (memory) are seen
        log.info("W4A16 M=%d N=%d K=%d: %d of %d candidates did not run (%s)", bucket, n, k, len(failed), len(plans),
                 "; ".join(failed[:3]) + (" ..." if len(failed) > 3 else ""))
    if not timings:
        log.warning("no W4A16 candidate ran correctly at M=%d N=%d K=%d; using the default plan", bucket, n, k)
        return default_plan(bucket, n, k, group, qweight.device), []
    best = min(timings, key=lambda t: t[1])[0]
    return best, [(p.name(), t) for p, t in timings]


TUNE_LOG: dict[PlanKey, list[tuple[str, float]]] = {}


def plan_key(m: int, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> PlanKey:
    k = qweight.shape[0] * 8
    return PlanKey(m_bucket(m), qweight.shape[1], k, k // scales.shape[0], dtype, str(qweight.device))


def plan_for(m: int, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> Plan:
    key = plan_key(m, qweight, scales, dtype)
    plan = _PLANS.get(key)
    if plan is None:
        device = qweight.device
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        can_tune = (gpu is not None and not torch.cuda.is_current_stream_capturing()
                    and os.environ.get("LMD_W4A16_AUTOTUNE", "1") != "0")
        plan = resolve_plan(key, device, gpu, can_tune,
                            lambda plans: tune(key.bucket, qweight, scales, zeros, dtype, plans))
        _PLANS[key] = plan
    return plan


def resolve_plan(key: PlanKey, device: torch.device, gpu: str | None, can_tune: bool,
                 tune_fn: Callable[[list[Plan]], tuple[Plan, list[tuple[str, float]]]]) -> Plan:
    """A GPU's plan from the on-disk cache, else from the table shipped for that GPU (`w4a16_shipped_plans`; with
    opt-in candidates its tuning never saw, they are tuned against its winner alone), else from tuning the
    candidates (then cached under a fingerprint of the whole list), else the untuned default. Cache entries and
    tables are the tuner timer's own (`w4a16_timer`)."""
    if gpu is None:
        return default_plan(key.bucket, key.n, key.k, key.group, device)
    plans = candidates(key.bucket, key.n, key.k, key.group, device)
    dtype = str(key.dtype).removeprefix("torch.")
    timer = tune_timer()
    disk_key = None
    if plan_cache.enabled():
        disk_key = plan_cache.cache_key(gpu, key.bucket, key.n, key.k, key.group, dtype + timer_suffix(timer),
                                        plan_cache.candidates_fingerprint([p.name() for p in plans]))
        cached = plan_cache.plan_from_json(plan_cache.load().get(disk_key, {}), PLAN_KINDS)
        if cached is not None:
            return cached
        shipped = shipped_plans.lookup(gpu, timer, key.bucket, key.n, key.k, key.group, dtype, plans)
        unjudged = shipped_plans.unjudged(gpu, timer, plans)
        if shipped is not None and (not unjudged or not can_tune):
            return shipped
        if shipped is not None:  # the table's winner stands for the families it was tuned over
            plans = [shipped, *unjudged]
    if not can_tune:
        return default_plan(key.bucket, key.n, key.k, key.group, device)
    plan, TUNE_LOG[key] = tune_fn(plans)
    if disk_key is not None:
        plan_cache.store(disk_key, plan)
    return plan


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype, W given in the engine layout (see w4a16_layout)."""
    k = x.shape[-1]
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"x has K={k} but qweight {tuple(qweight.shape)} packs K={qweight.shape[0] * 8}")
    lead = x.shape[:-1]
    x2d = x.reshape(-1, k)
    if x2d.shape[0] == 0 or not triton_usable(x):
        y = w4a16_matmul_reference(x2d, qweight, scales, zeros)
        if bias is not None:
            y = (y.to(torch.float32) + bias.to(torch.float32)).to(x.dtype)
        return y.reshape(*lead, -1)
    x2d = x2d.contiguous()
    plan = plan_for(x2d.shape[0], qweight, scales, zeros, x.dtype)
    return run_plan(plan, x2d, qweight, scales, zeros, bias).reshape(*lead, -1)


def random_weight(n: int, k: int, group_size: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random int4 weight in the engine layout (qweight, scales, zeros), to tune on: timing does not depend on it."""
    codes = torch.randint(0, 16, (k // 8, n), dtype=torch.int32, device=device)
    qweight = codes | (codes << 4) | (codes << 12)
    scales = torch.rand(k // group_size, n, dtype=dtype, device=device) * 0.01 + 0.001
    return qweight, scales, -8 * scales


def prewarm(n: int, k: int, group_size: int, dtype: torch.dtype, device: torch.device | str,
            max_m: int) -> dict[int, str]:
    """Tune, compile and size the workspace for every M bucket up to max_m; returns bucket -> chosen plan name."""
    device = torch.device(device)
    qweight, scales, zeros = random_weight(n, k, group_size, dtype, device)
    chosen: dict[int, str] = {}
    bucket = 1
    while True:
        x = torch.randn(bucket, k, dtype=dtype, device=device)
        if triton_usable(x):
            plan = plan_for(bucket, qweight, scales, zeros, dtype)
            run_plan(plan, x, qweight, scales, zeros)
            chosen[bucket] = plan.name()
        if bucket >= m_bucket(max_m):
            break
        bucket *= 2
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return chosen
