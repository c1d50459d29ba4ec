"""Full-shape GPU check of every W4A16 path against the fp32 reference (run on a CUDA machine).

    python3 benchmarks/gpu_kernel_tests.py [--quick] [--only gemv] [--no-graphs]

Checks, on fresh random inputs: each kernel path with a fixed config and the dispatcher's untuned plan, for
M in {1, 2, 3, 7, 16, 33, 64, 128, 256, 2048}, Llama-7B N/K, groups 64/128, fp16/bf16, with and without bias; that two
runs of a split-K kernel agree (no race); and that CUDA-graph replays after `prewarm` stay right (self-cleaning
split-K workspace). Exits 1 on any failure; writes a JSON log under $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmd.turbomind.kernels import nvrtc, w4a16_mma_gemm  # noqa: E402
from lmd.turbomind.kernels.w4a16 import default_plan, m_bucket, prewarm, run_plan, w4a16_linear  # noqa: E402
from lmd.turbomind.kernels.w4a16_dequant import DequantConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemm import GemmConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemm_wt import WtGemmConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemv import GemvConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_layout import quantize_to_engine, w4a16_matmul_reference  # noqa: E402
from lmd.turbomind.kernels.w4a16_mma_gemm import MmaGemmConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_mma_gemv import BLOCK_MS, MmaGemvConfig, launch_shape  # noqa: E402
from lmd.turbomind.kernels.w4a16_wgmma import WgmmaConfig  # noqa: E402

SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (12288, 4096))  # (N out, K in), Llama-7B
MS = (1, 2, 3, 7, 16, 33, 64, 128, 256, 2048)
TOL = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def paths_for(m: int) -> list:
    bucket = m_bucket(m)
    plans: list = []
    if bucket <= 4:
        plans.append(GemvConfig(block_n=128, block_k8=2, split_k=128, num_warps=1, block_m=bucket))
        plans.append(GemvConfig(block_n=256, block_k8=4, split_k=7, num_warps=2, block_m=4))  # uneven split
        plans.append(GemvConfig(block_n=512, block_k8=1, split_k=8, num_warps=2, block_m=bucket))  # many groups each
    if m <= 64:
        plans.append(GemmConfig(block_m=max(16, min(bucket, 64)), block_n=64, block_k=64, split_k=16))
        plans.append(GemmConfig(block_m=max(16, min(bucket, 64)), block_n=128, block_k=128, split_k=8,
                                nibble_dots=True))
    plans.append(GemmConfig(block_m=64, block_n=64, block_k=128, split_k=1, num_warps=4))
    if m <= 64:
        plans.append(WtGemmConfig(block_n=64, block_m=16, block_k=128, split_k=8))
        plans.append(WtGemmConfig(block_n=128, block_m=max(16, min(bucket, 64)), block_k=64, split_k=4,
                                  decode="interleave"))
        plans.append(WtGemmConfig(block_n=64, block_m=max(16, min(bucket, 64)), block_k=128, split_k=8, num_stages=3,
                                  decode="asm"))
        plans.append(WtGemmConfig(block_n=64, block_m=16, block_k=256, split_k=4, decode="asm"))  # BLOCK_K > group 128
        plans.append(WtGemmConfig(block_n=64, block_m=max(16, min(bucket, 64)), block_k=128, split_k=8, num_stages=3,
                                  decode="frag"))
        plans.append(WtGemmConfig(block_n=128, block_m=16, block_k=256, split_k=4, num_warps=8, decode="frag"))
        plans.append(WtGemmConfig(block_n=32, block_m=16, block_k=64, split_k=4, num_stages=2, decode="frag"))
    else:
        plans.append(WtGemmConfig(block_n=128, block_m=128, block_k=64, num_warps=8, num_stages=3))
        plans.append(WtGemmConfig(block_n=128, block_m=128, block_k=64, num_warps=8, num_stages=3,
                                  decode="interleave"))
        plans.append(WtGemmConfig(block_n=64, block_m=128, block_k=64, num_warps=4, num_stages=3, decode="asm"))
        plans.append(WtGemmConfig(block_n=128, block_m=128, block_k=64, num_warps=8, num_stages=3, decode="frag"))
        plans.append(WtGemmConfig(block_n=64, block_m=128, block_k=64, num_warps=4, num_stages=3, decode="frag-x"))
    if m >= 16:
        plans.append(DequantConfig())
    if m <= 128 and nvrtc.available():  # the CUDA mma.sync kernel (opt-in in the tuner, always checked here)
        block_m = next((b for b in BLOCK_MS if b >= m), BLOCK_MS[-1])
        plans.append(MmaGemvConfig(block_m, 4, 1, False))
        plans.append(MmaGemvConfig(block_m, 2, 4, True))
        plans.append(MmaGemvConfig(block_m, 8, 2, True, False))
    if m >= 16 and nvrtc.available():  # the CUDA mma.sync GEMM, likewise
        plans.append(MmaGemmConfig(2, 1, 16, 3, 4))
        plans.append(MmaGemmConfig(2, 2, 32, 4, 1))
        plans.append(MmaGemmConfig(2, 2, 64, 3, 2, False))
    if m >= 64 and nvrtc.available() and torch.cuda.get_device_capability() == (9, 0):  # the wgmma GEMM, likewise
        plans.append(WgmmaConfig(128, 64, 4, 0))
        plans.append(WgmmaConfig(128, 128, 4))
        plans.append(WgmmaConfig(256, 128, 3, 1, False))
        plans.append(WgmmaConfig(128, 128, 6, 0, rs=True))
    return plans


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.float()
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y - ref).norm() / ref.norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one shape, one group")
    parser.add_argument("--only", help="only plans whose name starts with this (gemv, gemm, wt, dequant, mma-gemv, "
                        "mma-gemm, wgmma)")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replays after prewarm")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    shapes = SHAPES[:1] if args.quick else SHAPES
    groups = (128,) if args.quick else (64, 128)
    results, failures = [], 0
    for n, k in shapes:
        for group in groups:
            w = torch.randn(n, k, device=dev) * 0.02
            for dtype in (torch.float16, torch.bfloat16):
                qw, s, z = quantize_to_engine(w, group, dtype)
                bias = torch.randn(n, device=dev, dtype=dtype)
                for m in MS:
                    x = torch.randn(m, k, device=dev, dtype=dtype)
                    ref = w4a16_matmul_reference(x, qw, s, z).float()
                    plans = paths_for(m) + [default_plan(m_bucket(m), n, k, group, dev)]
                    plans = [p for p in plans if args.only is None or p.name().startswith(args.only)]
                    for plan in plans:
                        use_bias = len(results) % 2 == 1
                        y = run_plan(plan, x, qw, s, z, bias if use_bias else None)
                        want = ref + bias.float() if use_bias else ref
                        err = rel_err(y, want)
                        ok = err < TOL[dtype]
                        if isinstance(plan, MmaGemvConfig):
                            splits = launch_shape(plan, m, n, k, group)[2]
                        elif isinstance(plan, MmaGemmConfig):
                            splits = w4a16_mma_gemm.launch_shape(plan, m, n, k)[0][2]
                        elif isinstance(plan, WgmmaConfig):  # stream-K (split 0) shares tiles between CTAs
                            splits = plan.split != 1
                        else:
                            splits = getattr(plan, "split_k", 1)
                        if ok and splits > 1:  # a race shows as a second run that disagrees
                            err2 = rel_err(run_plan(plan, x, qw, s, z, bias if use_bias else None), want)
                            ok = abs(err2 - err) < TOL[dtype]
                        failures += not ok
                        results.append(dict(n=n, k=k, group=group, dtype=str(dtype), m=m, plan=plan.name(),
                                            bias=use_bias, rel_err=err, ok=ok))
                        if not ok:
                            print(f"FAIL n={n} k={k} g={group} {dtype} m={m} {plan.name()}: rel err {err:.2e}")
            print(f"checked n={n} k={k} g={group}: {len(results)} cases, {failures} failures", flush=True)

    if args.no_graphs:
        return finish(results, failures)
    # CUDA graphs after prewarm: replays on new inputs must stay right (workspace and counters self-clean).
    n, k, group, dtype = 11008, 4096, 128, torch.float16
    qw, s, z = quantize_to_engine(torch.randn(n, k, device=dev) * 0.02, group, dtype)
    chosen = prewarm(n, k, group, dtype, dev, max_m=64)
    print("prewarm plans:", chosen)
    for m in (1, 3, 16, 64):
        x = torch.randn(m, k, device=dev, dtype=dtype)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = w4a16_linear(x, qw, s, z)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            err = rel_err(y, w4a16_matmul_reference(x, qw, s, z).float())
            ok = err < TOL[dtype]
            failures += not ok
            results.append(dict(n=n, k=k, group=group, dtype=str(dtype), m=m, plan="cuda-graph " + chosen[m_bucket(m)],
                                bias=False, rel_err=err, ok=ok))
            if not ok:
                print(f"FAIL cuda graph m={m}: rel err {err:.2e}")
    return finish(results, failures)


def finish(results: list[dict], failures: int) -> int:
    """Write the JSON log, print the worst error per dtype and path, return the exit status."""
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_kernel_tests.json").write_text(json.dumps(results, indent=1))
    worst = {}
    for r in results:
        key = (r["dtype"], r["plan"].split(" ")[0])
        worst[key] = max(worst.get(key, 0.0), r["rel_err"])
    for (dt, path), e in sorted(worst.items()):
        print(f"{dt:15s} {path:15s} worst rel err {e:.2e}")
    print(f"{len(results)} cases, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
