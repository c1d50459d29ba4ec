"""Where a W4A16 kernel's time goes (GPU only): the streaming ceiling of the packed weights, and plans side by side.

    python3 benchmarks/w4a16_probe.py [--shapes 4096x4096,11008x4096] [--plans-m 1,16,64]

1. Ceiling: a Triton kernel that only reads the packed weights (int32 [K / 8, N]) and folds them with xor, over a
   sweep of grid shapes (columns per program, packed rows per step, split-K, warps, pipeline stages), timed like
   benchmarks/kernels.py (one CUDA graph over weight copies larger than L2, median replay). The best row is what any
   W4A16 kernel reading the same bytes in the same kind of grid could reach; torch's device copy of the same bytes
   is printed beside it. A plan far below the ceiling loses time to its math or its reduction, not to the memory.
2. Plans: fixed configs of every path at the listed M, in the same harness (`PLANS`), so variants compare directly.

Writes $OUT/w4a16_probe.json (or ./w4a16_probe.json); prints tables last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from itertools import groupby
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import copies_for, graph_time_us  # noqa: E402
from lmd.turbomind.kernels.w4a16 import compile_all, output_is_wrong, run_plan  # noqa: E402
from lmd.turbomind.kernels.w4a16_epilogue import split_k_steps  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemm_wt import WtGemmConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemv import GemvConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_layout import quantize_to_engine, w4a16_matmul_reference  # noqa: E402


@triton.jit
def _stream_kernel(q_ptr, out_ptr, N, K8, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_K8)
    n_mask = offs_n < N
    first, last = split_k_steps(pid_k, tl.cdiv(K8, BLOCK_K8), SPLIT_K)
    acc = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.int32)
    for step in range(first, last):
        r = step * BLOCK_K8 + rows
        acc ^= tl.load(q_ptr + r[:, None] * N + offs_n[None, :], mask=(r < K8)[:, None] & n_mask[None, :], other=0,
                       eviction_policy="evict_first")
    tl.store(out_ptr + pid_k * N + offs_n, tl.xor_sum(acc, 0), mask=n_mask)


# (columns per program, packed rows per step, K steps per program, warps, stages)
STREAM_CONFIGS = [(512, 2, 2, 4, 1), (256, 2, 2, 2, 1), (128, 2, 2, 1, 1), (512, 2, 4, 4, 1), (256, 4, 4, 4, 1),
                  (256, 8, 4, 4, 1), (512, 4, 8, 4, 1), (256, 8, 8, 4, 3), (512, 8, 8, 8, 3), (256, 16, 8, 8, 3),
                  (128, 16, 16, 4, 3), (128, 32, 16, 8, 3), (256, 16, 16, 8, 4), (512, 8, 16, 8, 4),
                  (64, 64, 8, 4, 3), (128, 64, 8, 8, 3), (1024, 4, 16, 8, 3), (256, 32, 4, 8, 2)]


def stream_rows(n: int, k: int, dev: torch.device) -> list[dict]:
    k8 = k // 8
    copies = copies_for(k8 * n * 4)
    qws = [torch.randint(-2**31, 2**31 - 1, (k8, n), dtype=torch.int32, device=dev) for _ in range(copies)]
    rows = []
    for bn, bk8, steps, warps, stages in STREAM_CONFIGS:
        split = max(1, (k8 // bk8) // steps)
        out = torch.empty(split, n, dtype=torch.int32, device=dev)
        grid = (triton.cdiv(n, bn), split)

        def run(q, o=out, g=grid, c=(bn, bk8, split, warps, stages)):
            _stream_kernel[g](q, o, n, k8, BLOCK_N=c[0], BLOCK_K8=c[1], SPLIT_K=c[2], num_warps=c[3], num_stages=c[4])

        us = graph_time_us([lambda q=q: run(q) for q in qws])
        rows.append(dict(n=n, k=k, config=f"n{bn} k8x{bk8} s{split} w{warps} st{stages}", ctas=grid[0] * split,
                         us=us, tbps=k8 * n * 4 / us / 1e6))
    src = [torch.empty(k8 * n * 4, dtype=torch.uint8, device=dev) for _ in range(copies)]
    dst = torch.empty_like(src[0])
    us = graph_time_us([lambda s=s: dst.copy_(s) for s in src])
    rows.append(dict(n=n, k=k, config="torch copy (read + write)", ctas=0, us=us, tbps=k8 * n * 4 / us / 1e6))
    return rows


def plans_for(m: int, k: int) -> list:
    out: list = []
    if m <= 4:  # (columns, packed rows per step, warps, steps per program)
        for bn, bk8, warps, steps in ((512, 2, 4, 2), (256, 2, 2, 2), (512, 2, 4, 4), (1024, 2, 4, 2),
                                      (1024, 2, 4, 4), (1024, 1, 4, 4), (512, 2, 2, 2), (512, 2, 2, 4),
                                      (1024, 4, 4, 2), (2048, 2, 8, 2), (1024, 2, 8, 2), (512, 4, 4, 2)):
            out.append(GemvConfig(bn, bk8, max(1, (k // (8 * bk8)) // steps), warps, 1, m))
    bm = max(16, min(m, 64))
    tiles = ((64, bm, 128, 2, 4, 3), (64, bm, 128, 8, 4, 3), (128, bm, 128, 2, 4, 3), (128, bm, 128, 4, 4, 3),
             (128, bm, 64, 4, 4, 3), (128, bm, 128, 1, 4, 4))
    if m >= 64:  # (columns, tokens, k, split, warps, stages) around the tuner's winners for many tokens
        big = min(m, 128)
        tiles = ((64, big, 64, 1, 4, 3), (64, big, 128, 1, 4, 3), (64, 64, 128, 2, 4, 3), (64, 64, 64, 8, 4, 4),
                 (128, big, 64, 1, 8, 4), (64, big, 128, 2, 4, 3))
    for decode in ("asm", "frag", "frag-x"):
        for bn, bmt, bk, split, warps, stages in dict.fromkeys(tiles):  # at M = 64 two of the tiles coincide
            out.append(WtGemmConfig(bn, bmt, bk, split, warps, stages, decode))
    return out


def split_sweep(m: int, k: int) -> list:
    """`frag` and `frag-x` tiles for few tokens over split-K 1..16 (3, 5, 6 too: grids that fill one wave): short
    programs (few K steps, many CTAs) against long ones, x.T reordered per tile against once per call. At M = 1:
    GEMV tiles over split-K 16..152 in steps of 8 (whole and partial waves of programs)."""
    if m == 1:
        return [GemvConfig(bn, bk8, split, warps, 1, 1) for bn, bk8, warps in
                ((1024, 2, 4), (512, 2, 2), (512, 2, 4), (256, 2, 2), (1024, 1, 4), (2048, 2, 8))
                for split in range(16, 160, 8)]
    bm = max(16, min(m, 64))
    out = []
    for decode in ("frag", "frag-x"):
        for bn, warps in ((64, 4), (128, 8)):
            for bk in (64, 128, 256):
                for split in (1, 2, 3, 4, 5, 6, 8, 16):
                    for stages in (3, 4):
                        if k // bk // split >= 1:
                            out.append(WtGemmConfig(bn, bm, bk, split, warps, stages, decode))
    return out


def plan_rows(n: int, k: int, ms: list[int], dev: torch.device, sweep: bool = False, l2: bool = False) -> list[dict]:
    qw, s, z = quantize_to_engine(torch.randn(n, k, device=dev) * 0.02, 128, torch.float16)
    weight_bytes = qw.numel() * 4 + 2 * s.numel() * 2
    copies = copies_for(weight_bytes)
    # l2: every call reads the same weights, which then stay in the 60 MB L2 (the kernel's ceiling without HBM)
    weights = [(qw, s, z)] * copies if l2 else [(qw.clone(), s.clone(), z.clone()) for _ in range(copies)]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        ref = w4a16_matmul_reference(x.float(), qw, s, z)
        plans = (split_sweep if sweep else plans_for)(m, k)
        compile_all(plans, x, qw, s, z)  # Triton compiles on a thread pool; the timing below is serial
        for plan in plans:
            try:
                y = run_plan(plan, x, qw, s, z)
                us = graph_time_us([lambda w=w, p=plan, x=x: run_plan(p, x, *w) for w in weights])
            except Exception as exc:  # a config the compiler rejects is reported, not fatal
                rows.append(dict(n=n, k=k, m=m, plan=plan.name(), error=str(exc)[:200]))
                continue
            err = ((y.float() - ref).norm() / ref.norm()).item()
            rows.append(dict(n=n, k=k, m=m, plan=plan.name(), us=us, rel_err=err, wrong=output_is_wrong(y, ref),
                             tbps=weight_bytes / us / 1e6))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x4096,11008x4096", help="comma list of NxK")
    parser.add_argument("--plans-m", default="1,2,4,16,64", help="token counts for the plan comparison")
    parser.add_argument("--no-stream", action="store_true", help="skip the streaming ceiling sweep")
    parser.add_argument("--split-sweep", action="store_true",
                        help="instead of the fixed plans: `frag` tiles over split-K 1..16, warps and stages")
    parser.add_argument("--l2-resident", action="store_true",
                        help="time plans on one weight copy that stays in L2 (what the math costs without HBM)")
    args = parser.parse_args()
    dev = torch.device("cuda")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.plans_m.split(",")]
    stream, plans = [], []
    for n, k in shapes:
        plans += plan_rows(n, k, ms, dev, args.split_sweep, args.l2_resident)
        if not args.no_stream:
            stream += stream_rows(n, k, dev)
    out = Path(os.environ.get("OUT", "."), "w4a16_probe.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(dev), stream=stream, plans=plans), indent=1))
    print("\n| N×K | streaming config | CTAs | µs | TB/s |\n|---|---|---:|---:|---:|")
    for r in stream:
        print(f"| {r['n']}×{r['k']} | `{r['config']}` | {r['ctas']} | {r['us']:.1f} | {r['tbps']:.2f} |")
    if args.split_sweep:  # wrong outputs first (never ranked), then the fastest dozen of each (shape, M)
        def case(r: dict) -> tuple[int, int, int]:
            return r["n"], r["k"], r["m"]

        right = sorted((r for r in plans if "error" not in r and not r["wrong"]), key=lambda r: (*case(r), r["us"]))
        fastest = [r for _, rows in groupby(right, key=case) for r in list(rows)[:12]]
        plans = [r for r in plans if r.get("wrong")] + fastest
    print("\n| N×K | M | plan | µs | weight TB/s | rel err |\n|---|---:|---|---:|---:|---:|")
    for r in plans:
        if "error" in r:
            print(f"| {r['n']}×{r['k']} | {r['m']} | `{r['plan']}` | error | {r['error'][:60]} |")
        else:
            flag = " **wrong**" if r["wrong"] else ""
            print(f"| {r['n']}×{r['k']} | {r['m']} | `{r['plan']}` | {r['us']:.1f} | {r['tbps']:.2f} | "
                  f"{r['rel_err']:.1e}{flag} |")


if __name__ == "__main__":
    main()
