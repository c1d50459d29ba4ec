"""The tensor-core skinny GEMM (`lmd/turbomind/kernels/dense_mma.py`) against cuBLAS (F.linear) on the decode linears
of Llama-2-7B and Llama-3-8B at decode batch sizes M = 16-256 (issue 14, deliverable 3: the batch-64 step). A CUDA
machine.

    python3 benchmarks/dense_mma_probe.py [--ms 16,32,64,128,256] [--dtype fp16] [--variants ptr,tma] [--limit-s 300]

Each candidate is timed as a CUDA graph of 24 back-to-back calls that rotate over enough copies of the weight to
exceed L2 (cold weights, as in a forward pass), median of 7 replays. Every config's output is checked against
F.linear first. The grid of the pointer kernel (`ptr`): 64/128 weight rows per program, 64/128-wide key tiles,
4/8 warps, 3-5 stages, split-K 1/2/4; of the one fed by tensor descriptors (`tma`): the same tiles, 3-6 stages
where they fit in shared memory, split-K 1/2/4/8 where the grid has 96-600 programs (132 SMs). The planner's
present candidates for the rows' bucket (`dense_gemv_plan.CANDIDATES`) are always timed too. Writes
$OUT/dense_mma_probe.json (every timing) and prints a table last (µs per call, TB/s of weight bytes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernels import graph_time_us  # noqa: E402
from lmd.turbomind.kernels.dense_gemv_plan import CANDIDATES, bucket_of  # noqa: E402
from lmd.turbomind.kernels.dense_mma import DenseMmaConfig, dense_mma  # noqa: E402

SHAPES = {  # name: (N, K)
    "7b qkv": (12288, 4096), "7b wo": (4096, 4096), "7b w13": (22016, 4096), "7b w2": (4096, 11008),
    "8b qkv": (6144, 4096), "8b w13": (28672, 4096), "8b w2": (4096, 14336),
}
CALLS = 24
L2_BYTES = 200 << 20  # rotate over copies worth more than this (the H200's L2 is 60 MB)


SMEM_BYTES = 220 << 10  # of the H200's 227 KB per block, some left for the epilogue's scratch


def grid(m: int, n: int, variant: str) -> list[DenseMmaConfig]:
    tma = variant == "tma"
    configs = []
    for bn, bk, warps, stages, split in itertools.product((64, 128), (64, 128), (4, 8), (3, 4, 5, 6),
                                                          (1, 2, 4, 8) if tma else (1, 2, 4)):
        if bn * max(16, m) > 128 * 128 and warps == 4:  # the accumulator would not fit 4 warps' registers
            continue
        if warps == 8 and m < 64:
            continue
        if tma and ((bn + max(16, m)) * bk * 2 * stages > SMEM_BYTES or not 96 <= -(-n // bn) * split <= 600):
            continue
        if not tma and (stages == 6 or (bk == 128 and stages == 5)):
            continue
        configs.append(DenseMmaConfig(bn, bk, warps, stages, split, tma))
    return configs


def planner_candidates(m: int) -> list[DenseMmaConfig]:
    bucket = bucket_of(m)
    return [c for c in CANDIDATES.get(bucket, ()) if isinstance(c, DenseMmaConfig)] if bucket else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", default="16,32,64,128,256")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--variants", default="ptr,tma", help="kernels to sweep: ptr (pointer loads), tma (descriptors)")
    p.add_argument("--limit-s", type=float, default=300.0, help="stop starting new shapes after this long")
    args = p.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    t0 = time.time()
    results, timings = [], []
    for m in (int(v) for v in args.ms.split(",")):
        for name in args.shapes.split(","):
            if time.time() - t0 > args.limit_s:
                print(f"time limit: {name} m{m} and later skipped", flush=True)
                continue
            n, k = SHAPES[name]
            copies = max(2, -(-L2_BYTES // (n * k * 2)))
            ws = [(torch.randn(n, k, device=dev, generator=g) * 0.02).to(dtype) for _ in range(copies)]
            x = torch.randn(m, k, device=dev, generator=g).to(dtype)
            ref = F.linear(x.float(), ws[0].float())
            calls = [ws[i % copies] for i in range(CALLS)]
            cublas = graph_time_us([lambda w=w, x=x: F.linear(x, w) for w in calls], reps=7)
            timed = []
            configs = planner_candidates(m) + [c for v in args.variants.split(",") for c in grid(m, n, v)]
            for config in dict.fromkeys(configs):
                try:
                    out = dense_mma(x, ws[0], None, config)
                except Exception as exc:  # noqa: BLE001 (a config the compiler refuses: out of registers/smem)
                    print(f"{name} m{m} {config.name()}: {type(exc).__name__}", flush=True)
                    continue
                error = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                if error > 1e-2:
                    sys.exit(f"{name} m{m} {config.name()}: relative error {error:.3g} against F.linear")
                us = graph_time_us([lambda c=config, w=w, x=x: dense_mma(x, w, None, c) for w in calls], reps=7)
                timed.append((us, config))
                timings.append(dict(shape=name, m=m, config=config.name(), us=us))
            best_us, best = min(timed, key=lambda t: t[0])
            gb = n * k * 2 / 1e9
            top = sorted(timed, key=lambda t: t[0])[:5]
            results.append(dict(shape=name, m=m, n=n, k=k, cublas_us=cublas, triton_us=best_us, config=best.name(),
                                cublas_tbs=gb / cublas * 1e3, triton_tbs=gb / best_us * 1e3, speedup=cublas / best_us,
                                top=[(c.name(), us) for us, c in top]))
            print(f"{name} m{m}: cuBLAS {cublas:.1f} µs, Triton {best_us:.1f} µs ({best.name()}); top "
                  + ", ".join(f"{c.name()} {us:.1f}" for us, c in top), flush=True)
            del ws, x, ref, calls
            out_dir = Path(os.environ.get("OUT", "."))
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "dense_mma_probe.json").write_text(json.dumps(dict(results=results, timings=timings), indent=1))
    print(f"\n{'shape':<8} {'M':>3} {'cuBLAS µs':>10} {'TB/s':>5} {'Triton µs':>10} {'TB/s':>5} {'speed-up':>8}  config")
    for r in results:
        print(f"{r['shape']:<8} {r['m']:>3} {r['cublas_us']:>10.2f} {r['cublas_tbs']:>5.2f} {r['triton_us']:>10.2f} "
              f"{r['triton_tbs']:>5.2f} {r['speedup']:>7.2f}x  {r['config']}")


if __name__ == "__main__":
    main()
