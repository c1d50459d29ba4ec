"""The skinny dense GEMM (`lmd/turbomind/kernels/dense_gemv.py`) against cuBLAS (F.linear) on the decode linears of
Llama-2-7B and Llama-3-8B, M = 1, 2, 4, 8, fp16 (issue 14: batch-1 decode is 84 % GEMM time). A CUDA machine.

    python3 benchmarks/dense_gemv_probe.py [--ms 1,2,4,8] [--dtype fp16]

Each candidate is timed as a CUDA graph of 20 back-to-back calls (no launch gaps; the weights, 32-250 MB, do not fit
in L2, so every call streams them from HBM), median of 7 replays. M=1 searches the whole config grid; larger M
re-time the 8 best M=1 configs and smaller K blocks. Every config's output is checked against F.linear first.
Writes $OUT/dense_gemv_probe.json and prints a table last (µs per call and TB/s of weight bytes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernels import graph_time_us as shared_graph_time_us  # noqa: E402
from lmd.turbomind.kernels.dense_gemv import DenseGemvConfig, dense_gemv  # noqa: E402

SHAPES = {  # name: (N, K)
    "7b qkv": (12288, 4096), "7b wo": (4096, 4096), "7b w13": (22016, 4096), "7b w2": (4096, 11008),
    "7b lm_head": (32000, 4096), "8b qkv": (6144, 4096), "8b w13": (28672, 4096), "8b w2": (4096, 14336),
}
GRID = [DenseGemvConfig(n, k, w, s) for n, k, w, s in itertools.product((1, 2, 4, 8), (256, 512, 1024), (2, 4, 8),
                                                                         (2, 3, 4))]
CALLS = 20


def graph_time_us(fn) -> float:
    """Per call, `CALLS` back-to-back calls captured as one CUDA graph, median of 7 replays."""
    return shared_graph_time_us([fn] * CALLS, reps=7)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", default="1,2,4,8")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    args = p.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    results = []
    best_m1: dict[str, list[tuple[float, DenseGemvConfig]]] = {}
    for m in (int(v) for v in args.ms.split(",")):
        for name, (n, k) in SHAPES.items():
            w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(dtype)
            x = torch.randn(m, k, device=dev, generator=g).to(dtype)
            ref = F.linear(x.float(), w.float())
            cublas = graph_time_us(lambda x=x, w=w: F.linear(x, w))
            if m == 1:
                candidates = GRID
            else:
                top = [c for _, c in sorted(best_m1[name], key=lambda t: t[0])[:8]]
                candidates = list(dict.fromkeys(top + [DenseGemvConfig(c.block_n, c.block_k // 2, c.num_warps,
                                                                       c.num_stages) for c in top if c.block_k > 256]))
            timed = []
            for config in candidates:
                try:
                    out = dense_gemv(x, w, None, config)
                except Exception as exc:  # noqa: BLE001 (a config the compiler refuses: out of registers/smem)
                    print(f"{name} m{m} {config.name()}: {type(exc).__name__}", flush=True)
                    continue
                error = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                if error > 1e-2:
                    sys.exit(f"{name} m{m} {config.name()}: relative error {error:.3g} against F.linear")
                timed.append((graph_time_us(lambda c=config, x=x, w=w: dense_gemv(x, w, None, c)), config))
            if m == 1:
                best_m1[name] = timed
            best_us, best = min(timed, key=lambda t: t[0])
            gb = n * k * w.element_size() / 1e9
            results.append(dict(shape=name, m=m, n=n, k=k, cublas_us=cublas, triton_us=best_us, config=best.name(),
                                cublas_tbs=gb / cublas * 1e6 / 1e3, triton_tbs=gb / best_us * 1e6 / 1e3,
                                speedup=cublas / best_us))
            print(f"{name} m{m}: cuBLAS {cublas:.1f} µs, Triton {best_us:.1f} µs ({best.name()})", flush=True)
            del w, x, ref
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "dense_gemv_probe.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'shape':<12} {'M':>2} {'cuBLAS µs':>10} {'TB/s':>5} {'Triton µs':>10} {'TB/s':>5} {'speed-up':>8}  config")
    for r in results:
        print(f"{r['shape']:<12} {r['m']:>2} {r['cublas_us']:>10.2f} {r['cublas_tbs']:>5.2f} {r['triton_us']:>10.2f} "
              f"{r['triton_tbs']:>5.2f} {r['speedup']:>7.2f}x  {r['config']}")


if __name__ == "__main__":
    main()
