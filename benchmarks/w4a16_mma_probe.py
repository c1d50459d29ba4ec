"""The CUDA W4A16 kernels on the GPU, the mma.sync GEMV for 1-128 token rows (`w4a16_mma_gemv`), the mma.sync GEMM
for 16 rows and more (`w4a16_mma_gemm`) and the wgmma GEMM for 64 rows and more (`w4a16_wgmma`): correctness, then
speed beside lmd's shipped W4A16 plan for the same bucket and fp16 cuBLAS (issue 18).

    python3 benchmarks/w4a16_mma_probe.py [--ms 1,4,8,16,32,64,128,256,1024] [--shapes 12288x4096,...] [--quick]
                                          [--families gemv,gemm,wgmma] [--no-bench]

1. Checks: fp16 and bf16, groups 32/64/128, with and without bias, split and unsplit launches, the GEMV at M =
   1..128 (every block size, several token tiles), the mma.sync GEMM at M = 16..300 (every warp height, short last
   tiles) and the wgmma GEMM (sm_90 only) at M = 64..1024, against `w4a16_matmul_reference` (`output_is_wrong`, the
   tuner's limits) and each kernel's PyTorch twin; 20 CUDA-graph replays of each must repeat the eager result. Any
   failure makes the exit non-zero and skips nothing else.
2. Timing: µs per call in a CUDA graph over weight copies worth more than L2 (as `benchmarks/kernels.py`), every
   config of `gemv_configs` / `gemm_configs` / `wgmma_configs`, beside the plan `plan_for` picks today (shipped
   table or tuning) and fp16 cuBLAS.
Writes $OUT/w4a16_mma_probe.json and prints a table last.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmd.turbomind.kernels.gpu_timing import graph_ms  # noqa: E402
from lmd.turbomind.kernels.w4a16 import output_is_wrong, plan_for, run_plan  # noqa: E402
from lmd.turbomind.kernels.w4a16_layout import quantize_to_engine, w4a16_matmul_reference  # noqa: E402
from lmd.turbomind.kernels.w4a16_mma_gemm import MmaGemmConfig, mma_gemm, mma_gemm_reference  # noqa: E402
from lmd.turbomind.kernels.w4a16_mma_gemm import tuner_configs as gemm_tuner_configs  # noqa: E402
from lmd.turbomind.kernels.w4a16_mma_gemv import (  # noqa: E402
    MAX_ROWS,
    MmaGemvConfig,
    launch_shape,
    mma_gemv,
    mma_gemv_reference,
    tuner_configs,
)
from lmd.turbomind.kernels.w4a16_wgmma import WgmmaConfig, wgmma_gemm  # noqa: E402
from lmd.turbomind.kernels.w4a16_wgmma import tuner_configs as wgmma_tuner_configs  # noqa: E402

SHAPES = "12288x4096,4096x4096,22016x4096,4096x11008"
GEMM_CHECKS = (MmaGemmConfig(2, 1, 16, 3, 1), MmaGemmConfig(2, 2, 32, 4, 4), MmaGemmConfig(1, 2, 64, 3, 1),
               MmaGemmConfig(2, 2, 64, 2, 3), MmaGemmConfig(1, 8, 16, 4, 1), MmaGemmConfig(4, 2, 32, 3, 2, False),
               MmaGemmConfig(2, 4, 64, 4, 1))
WGMMA_CHECKS = (WgmmaConfig(128, 64, 3), WgmmaConfig(128, 128, 4, 2), WgmmaConfig(256, 128, 3, 0),
                WgmmaConfig(128, 256, 4, 1, False), WgmmaConfig(256, 64, 3, 3), WgmmaConfig(128, 64, 6, 0),
                WgmmaConfig(128, 128, 6, 0, rs=True), WgmmaConfig(256, 128, 4, 1, rs=True),
                WgmmaConfig(128, 64, 6, 2, rs=True), WgmmaConfig(128, 256, 6, 0, rs=True, depth=3),
                WgmmaConfig(256, 128, 6, 1, rs=True, depth=3))
SHAPES_CHECKED = ((256, 1024, 128), (128, 512, 64), (256, 768, 32), (4096, 4096, 128), (512, 11008, 128))
HANG_S = 150  # seconds without a progress line after which the probe ends itself (`watchdog`)
STARTED = time.time()


@dataclass(frozen=True)
class Family:
    """What the checks run of one kernel: its launch, its PyTorch twin, the (N, K, group) shapes and M values, the
    configs checked at each M, and the configs whose CUDA-graph replays are checked (on `replay_rows` rows)."""
    kernel: Callable
    twin: Callable
    shapes: tuple[tuple[int, int, int], ...]
    ms: tuple[int, ...]
    configs: Callable[[int], Sequence]
    replayed: tuple
    replay_rows: int


def progress(kernel: str, dtype: torch.dtype, n: int, k: int, group: int) -> None:
    """A line as each check shape starts (the output of a call that hangs ends at the kernel and shape that did)."""
    torch.cuda.synchronize()
    print(f"  checking {kernel} {str(dtype)[6:]} n{n} k{k} g{group} at {time.time() - STARTED:.0f} s", flush=True)
    watchdog()


def watchdog() -> None:
    """(Re)arms the hang guard: if nothing re-arms it for HANG_S, every thread's traceback is printed and the
    process exits, so that a kernel that never ends costs the device call minutes, not the rest of its limit."""
    faulthandler.dump_traceback_later(HANG_S, exit=True)


def gemv_checks(m: int) -> list[MmaGemvConfig]:
    """The GEMV configs checked at M rows: both token blocks up to 16 rows (the one of M's size where it matters),
    the dequantizing 32-row block at any M."""
    small = 8 if m <= 8 else 16
    configs = [MmaGemvConfig(small, 4, 1, False), MmaGemvConfig(16, 2, 2, True), MmaGemvConfig(16, 8, 64, False),
               MmaGemvConfig(small, 4, 2, True, False), MmaGemvConfig(32, 4, 1, False),
               MmaGemvConfig(32, 2, 2, True, False), MmaGemvConfig(32, 8, 64, True),
               # cp.async stages: fewer groups than stages, a short last CTA, pair decode, the dequantizing block
               MmaGemvConfig(small, 4, 8, stages=4), MmaGemvConfig(small, 8, 4, stages=3),
               MmaGemvConfig(16, 2, 3, False, False, stages=2), MmaGemvConfig(32, 4, 4, stages=3)]
    return [c for c in configs if m <= 16 or c.block_m == 32]


FAMILIES = {
    "gemv": Family(mma_gemv, mma_gemv_reference,
                   ((256, 1024, 128), (128, 512, 64), (192, 768, 32), (4096, 4096, 128), (64, 11008, 128)),
                   (1, 2, 5, 8, 9, 16, 20, 32, 45, 128), gemv_checks,
                   (MmaGemvConfig(8, 2, 1, False), MmaGemvConfig(8, 4, 4, stages=3)), 3),
    "gemm": Family(mma_gemm, mma_gemm_reference, SHAPES_CHECKED, (16, 20, 45, 64, 128, 300), lambda m: GEMM_CHECKS,
                   (MmaGemmConfig(2, 1, 16, 3, 4), MmaGemmConfig(2, 2, 32, 3, 1)), 37),
    "wgmma": Family(wgmma_gemm, mma_gemm_reference, SHAPES_CHECKED, (64, 100, 128, 256, 300, 1024),
                    lambda m: WGMMA_CHECKS,
                    (WgmmaConfig(128, 64, 4, 0), WgmmaConfig(128, 128, 4, 3), WgmmaConfig(128, 128, 6, 0, rs=True),
                     WgmmaConfig(128, 256, 6, 0, rs=True, depth=3)),
                    77),
}


def checked_configs(family: Family) -> list:
    """Every config the checks of a family launch (to build them first)."""
    return list(dict.fromkeys([c for m in family.ms for c in family.configs(m)] + list(family.replayed)))


def precompile(jobs: list[tuple[object, torch.dtype, int, object]]) -> float:
    """Build every (kernel module, dtype, group, config) the probe will launch, on a thread pool (NVRTC takes ~1 s a
    specialization; serially the builds alone would take minutes of the call). Returns the seconds it took."""
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    from lmd.turbomind.kernels import w4a16_mma_gemm, w4a16_mma_gemv, w4a16_wgmma
    from lmd.turbomind.kernels.pdl import pdl_enabled

    device = torch.cuda.current_device()
    pdl = pdl_enabled(torch.device("cuda", device))
    start = time.time()

    def build(job) -> None:
        kind, dtype, group, cfg = job
        module = {"gemv": w4a16_mma_gemv, "gemm": w4a16_mma_gemm, "wgmma": w4a16_wgmma}[kind]
        with contextlib.suppress(Exception):  # a failing build shows again, with its message, at its first launch
            module._kernel(dtype, group, cfg, pdl, device)

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(build, list(dict.fromkeys(jobs))))
    return time.time() - start


def gemv_configs(m: int) -> list[MmaGemvConfig]:
    """The tuner's configs for M's bucket, more groups per warp, and a few with the per-pair decode to compare."""
    bucket = min(1 << max(m - 1, 0).bit_length(), MAX_ROWS)  # past MAX_ROWS: the 128-row configs, more tiles
    tuned = tuner_configs(bucket, 4096, 4096, 128, staged=True)
    block_m = tuned[0].block_m
    more = [MmaGemvConfig(block_m, w, 8, pf) for w in (2, 4) for pf in (False, True)]
    pair = [MmaGemvConfig(block_m, w, gpw, pf, False) for w, gpw, pf in ((4, 2, True), (8, 1, False), (4, 4, True))]
    return tuned + more + pair


def gemm_configs(m: int, n: int, k: int) -> list[MmaGemmConfig]:
    """The tuner's configs for M's bucket, and deeper pipelines of its largest tiles."""
    bucket = min(1 << max(m - 1, 0).bit_length(), 4096)
    tuned = gemm_tuner_configs(bucket, n, k, 128, torch.cuda.get_device_properties(0).multi_processor_count)
    deeper = [MmaGemmConfig(c.warps_n, c.warps_m, c.warp_m, 6, c.split) for c in tuned[-4:] if c.stages == 4]
    return tuned + deeper


def wgmma_configs(m: int, n: int, k: int) -> list[WgmmaConfig]:
    """The tuner's configs for M's bucket (one CTA a tile and stream-K), and 2 or 3 CTAs a tile."""
    bucket = min(1 << max(m - 1, 0).bit_length(), 4096)
    tuned = wgmma_tuner_configs(bucket, n, k, 128)
    more = [WgmmaConfig(c.block_n, c.block_t, c.stages, split, rs=c.rs, depth=c.depth) for c in tuned
            for split in (2, 3)]
    return list(dict.fromkeys(tuned + more))


def replays_repeat(run, x: torch.Tensor) -> bool:
    """20 graph replays of run(x) give the eager output (the split-K workspace cleans itself between calls)."""
    eager = run(x)
    holder = []
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(x)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        holder.append(run(x))
    for _ in range(20):
        graph.replay()
        if output_is_wrong(holder[0], eager.float()) or not torch.allclose(holder[0], eager, rtol=1e-2, atol=1e-3):
            return False
    return True


def judge(failures: list[str], what: str, y: torch.Tensor, ref: torch.Tensor, twin: torch.Tensor,
          bias: torch.Tensor | None) -> None:
    """A failure unless y is within the tuner's limits of the reference and close to the kernel's twin."""
    add = bias.float() if bias is not None else 0
    want = ref + add
    err = ((y.float() - want).norm() / want.norm()).item()
    twin_err = ((y.float() - twin.float() - add).norm() / want.norm()).item()
    if output_is_wrong(y, want) or twin_err > (1e-2 if y.dtype == torch.bfloat16 else 2e-3):
        failures.append(f"{what} bias={bias is not None}: rel err {err:.3g}, vs twin {twin_err:.3g}; "
                        + wrong_pattern(y.float(), want))


def wrong_pattern(y: torch.Tensor, want: torch.Tensor) -> str:
    """Where the wrong outputs sit, to tell a layout slip from a race on the first run: the share of wrong elements
    (off by more than 5 % of their row's largest output) and which token rows and channels mod 16 they fall on."""
    bad = ~((y - want).abs() <= 0.05 * want.abs().amax(dim=1, keepdim=True))  # NaN counts as wrong
    if not bool(bad.any()):
        return "no element off by 5 %"
    rows = sorted({int(r) for r in torch.nonzero(bad.any(dim=1)).flatten() % 16})
    cols = sorted({int(c) for c in torch.nonzero(bad.any(dim=0)).flatten() % 16})
    nonfinite = int((~torch.isfinite(y)).sum())
    return (f"{float(bad.float().mean()):.1%} wrong ({nonfinite} not finite), token rows mod 16 {rows}, channels mod 16 "
            f"{cols}, first wrong at {tuple(int(v) for v in torch.nonzero(bad)[0])}")


def check(failures: list[str], name: str, family: Family) -> int:
    """Every config of the family at every shape, M, dtype, with and without bias, against the reference and the
    twin (`judge`); then graph replays. Returns the cases run; failures go to `failures`."""
    if name == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        failures.append("wgmma not checked: not an sm_90 device")
        return 0
    dev = torch.device("cuda")
    cases = 0
    for dtype in (torch.float16, torch.bfloat16):
        for n, k, group in family.shapes:
            progress(name, dtype, n, k, group)
            w = torch.randn(n, k, device=dev) * 0.02
            qw, s, z = quantize_to_engine(w, group, dtype)
            bias = torch.randn(n, device=dev, dtype=dtype)
            for m in family.ms:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                ref = w4a16_matmul_reference(x.float(), qw, s, z)
                twin = family.twin(x, qw, s, z)
                for cfg in family.configs(m):
                    if n % getattr(cfg, "block_n", 64):
                        continue
                    for b in (None, bias):
                        cases += 1
                        judge(failures, f"{cfg.name()} {dtype} n{n} k{k} g{group} m{m}",
                              family.kernel(x, qw, s, z, b, cfg), ref, twin, b)
            for cfg in family.replayed:
                if n % getattr(cfg, "block_n", 64) == 0:
                    cases += 1
                    if not replays_repeat(lambda x, c=cfg, w=(qw, s, z): family.kernel(x, *w, None, c),
                                          torch.randn(family.replay_rows, k, device=dev, dtype=dtype)):
                        failures.append(f"graph replay differs {cfg.name()} {dtype} n{n} k{k}")
    return cases


def workspaces_stay_apart(failures: list[str]) -> int:
    """A split-K launch of the mma GEMV (adding its partials atomically into the zeroed workspace) right after a
    stream-K launch of the wgmma GEMM (leaving its partial slots as written) must still be right: the two kinds
    of workspace must not share memory. Returns the cases run."""
    dev = torch.device("cuda")
    n, k, group = 4096, 4096, 128
    qw, s, z = quantize_to_engine(torch.randn(n, k, device=dev) * 0.02, group, torch.float16)
    x = torch.randn(256, k, device=dev, dtype=torch.float16)
    split = next(c for c in tuner_configs(1, n, k, group) if launch_shape(c, 1, n, k, group)[2] > 1)
    cases = 0
    for cfg in (WgmmaConfig(128, 128, 6, 0, rs=True), WgmmaConfig(256, 64, 4, 0)):
        wgmma_gemm(x, qw, s, z, None, cfg)
        y = mma_gemv(x[:1], qw, s, z, None, split)
        cases += 1
        if output_is_wrong(y, w4a16_matmul_reference(x[:1].float(), qw, s, z)):
            failures.append(f"{split.name()} split-K after {cfg.name()}: wrong (the workspaces overlap)")
    return cases


def graph_us(fns: list) -> float:
    return graph_ms(fns, 30) * 1000.0


def fastest(family: dict[str, float]) -> tuple[float, str]:
    return min(((v, name) for name, v in family.items() if v == v), default=(float("nan"), "none right"))


def bench(n: int, k: int, ms: list[int], group: int, quick: bool, chosen: set[str]) -> list[dict]:
    wgmma_ok = torch.cuda.get_device_capability() == (9, 0) and "wgmma" in chosen
    dev = torch.device("cuda")
    w = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
    qw, s, z = quantize_to_engine(w, group, torch.float16)
    q_bytes = qw.numel() * 4 + 2 * s.numel() * 2
    copies = max(4, min(64, -(-256 * 2**20 // q_bytes)))
    quant = [(qw.clone(), s.clone(), z.clone()) for _ in range(copies)]
    fp16_w = [w.clone() for _ in range(max(4, min(copies, -(-256 * 2**20 // (n * k * 2)))))]
    rows = []
    for m in ms:
        watchdog()
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        t_fp16 = graph_us([lambda wi=wi, x=x: F.linear(x, wi) for wi in fp16_w])
        plan = plan_for(m, qw, s, z, torch.float16)
        t_plan = graph_us([lambda p=p, x=x, c=plan: run_plan(c, x, *p) for p in quant])
        ref = w4a16_matmul_reference(x.float(), qw, s, z)
        families = {"gemv": (mma_gemv, gemv_configs(m) if m <= MAX_ROWS and "gemv" in chosen else []),
                    "gemm": (mma_gemm, gemm_configs(m, n, k) if m >= 16 and "gemm" in chosen else []),
                    "wgmma": (wgmma_gemm, wgmma_configs(m, n, k) if m >= 64 and wgmma_ok else [])}
        timings: dict[str, dict[str, float]] = {}
        for family, (kernel, configs) in families.items():
            timings[family] = {}
            for cfg in configs[::3] if quick else configs:
                if n % getattr(cfg, "block_n", 64):
                    continue
                y = kernel(x, qw, s, z, None, cfg)
                if output_is_wrong(y, ref):
                    timings[family][cfg.name()] = float("nan")
                    continue
                timings[family][cfg.name()] = graph_us([lambda p=p, x=x, c=cfg, f=kernel: f(x, *p, None, c)
                                                        for p in quant])
        (gemv_us, gemv_name), (gemm_us, gemm_name) = fastest(timings["gemv"]), fastest(timings["gemm"])
        wgmma_us, wgmma_name = fastest(timings["wgmma"])
        best = min((v for v in (gemv_us, gemm_us, wgmma_us) if v == v), default=float("nan"))
        moved = q_bytes + 2 * m * (k + n)
        row = dict(n=n, k=k, m=m, fp16_us=t_fp16, plan=plan.name(), plan_us=t_plan, gemv_us=gemv_us,
                   gemv_best=gemv_name, gemm_us=gemm_us, gemm_best=gemm_name, wgmma_us=wgmma_us,
                   wgmma_best=wgmma_name, mma_us=best,
                   mma_tb_s=moved / (best * 1e-6) / 1e12, vs_fp16=t_fp16 / best, vs_plan=t_plan / best,
                   timings=timings)
        rows.append(row)
        print(f"{n}x{k} m={m:4d} fp16 {t_fp16:6.1f} plan {t_plan:6.1f} [{plan.name()}] gemv {gemv_us:6.1f} "
              f"[{gemv_name}] gemm {gemm_us:6.1f} [{gemm_name}] wgmma {wgmma_us:6.1f} [{wgmma_name}] "
              f"{row['mma_tb_s']:.2f} TB/s x{row['vs_fp16']:.2f} "
              f"fp16 x{row['vs_plan']:.2f} plan", flush=True)
        for family, found in timings.items():
            top = sorted((v, name) for name, v in found.items() if v == v)[:4]
            if top:
                print(f"    {family} top: " + ", ".join(f"{name} {v:.1f}" for v, name in top), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--ms", default="1,4,8,16,32,64,128,256,1024")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="a third of the configs")
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--families", default="gemv,gemm,wgmma",
                        help="the kernels to check and time, comma-separated (a rerun of one after a fix)")
    args = parser.parse_args()
    chosen = set(args.families.split(","))
    if not chosen <= {"gemv", "gemm", "wgmma"}:
        parser.error(f"--families: gemv, gemm and/or wgmma, not {args.families}")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}", flush=True)
    sm90 = torch.cuda.get_device_capability() == (9, 0) and "wgmma" in chosen
    jobs = [(kind, dtype, group, cfg) for dtype in (torch.float16, torch.bfloat16) for group in (32, 64, 128)
            for kind, family in FAMILIES.items() if kind in chosen and (kind != "wgmma" or sm90)
            for cfg in checked_configs(family)]
    for shape in ([] if args.no_bench else args.shapes.split(",")):
        n, k = (int(v) for v in shape.split("x"))
        for m in (int(v) for v in args.ms.split(",")):
            jobs += [("gemv", torch.float16, args.group, c)
                     for c in (gemv_configs(m) if m <= MAX_ROWS and "gemv" in chosen else [])]
            jobs += [("gemm", torch.float16, args.group, c)
                     for c in (gemm_configs(m, n, k) if m >= 16 and "gemm" in chosen else [])]
            jobs += [("wgmma", torch.float16, args.group, c) for c in (wgmma_configs(m, n, k) if m >= 64 and sm90
                                                                        else [])]
    print(f"built {len(set(jobs))} specializations in {precompile(jobs):.1f} s", flush=True)
    if sm90:  # stream-K sizes its grid by the driver's occupancy: the small tile is built for two CTAs an SM
        from lmd.turbomind.kernels import nvrtc, w4a16_wgmma
        from lmd.turbomind.kernels.pdl import pdl_enabled

        for cfg in (WgmmaConfig(128, 64, 3, 0), WgmmaConfig(128, 128, 4, 0)):
            kernel = w4a16_wgmma._kernel(torch.float16, args.group, cfg, pdl_enabled(torch.device("cuda")),
                                         torch.cuda.current_device())
            resident = nvrtc.max_active_blocks(kernel, w4a16_wgmma.THREADS, w4a16_wgmma.shared_bytes(cfg, args.group))
            print(f"{cfg.name()}: {resident} CTAs an SM (built for {w4a16_wgmma.ctas_per_sm(cfg, args.group)})",
                  flush=True)
    start = time.time()
    failures: list[str] = []
    cases = sum(check(failures, name, family) for name, family in FAMILIES.items() if name in chosen)
    cases += workspaces_stay_apart(failures) if sm90 else 0
    print(f"checks: {cases} cases, {len(failures)} failures ({time.time() - start:.1f} s)", flush=True)
    for f in failures[:30]:
        print("  FAIL " + f)
    rows = []
    out = Path(os.environ.get("OUT", "."), "w4a16_mma_probe.json")
    out.write_text(json.dumps(dict(gpu=props.name, cases=cases, failures=failures, rows=rows), indent=1))
    if not args.no_bench:
        for shape in args.shapes.split(","):  # written after each shape: a call cut short keeps what it timed
            n, k = (int(v) for v in shape.split("x"))
            rows += bench(n, k, [int(v) for v in args.ms.split(",")], args.group, args.quick, chosen)
            out.write_text(json.dumps(dict(gpu=props.name, cases=cases, failures=failures, rows=rows), indent=1))
    faulthandler.cancel_dump_traceback_later()
    print(f"\nmma.sync W4A16 g{args.group}, {props.name}: µs per call (graph, cold weights)")
    print(f"{'N x K':12s} {'M':>4s} {'fp16':>7s} {'plan':>7s} {'gemv':>7s} {'gemm':>7s} {'wgmma':>7s} {'x fp16':>7s} "
          f"{'x plan':>7s}  best config")
    for r in rows:
        best = next(r[f"{f}_best"] for f in ("gemv", "gemm", "wgmma") if r[f"{f}_us"] == r["mma_us"]) \
            if r["mma_us"] == r["mma_us"] else "none right"
        print(f"{r['n']}x{r['k']:<7d} {r['m']:4d} {r['fp16_us']:7.1f} {r['plan_us']:7.1f} {r['gemv_us']:7.1f} "
              f"{r['gemm_us']:7.1f} {r['wgmma_us']:7.1f} {r['vs_fp16']:7.2f} {r['vs_plan']:7.2f}  {best}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
