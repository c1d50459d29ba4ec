"""Run a few W4A16 kernel configs a handful of times, for a profiler (Nsight Compute) to look at.

    ncu --clock-control none --kernel-name regex:_gem --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        python3 benchmarks/kernel_profile.py --n 11008 --k 4096 --m 1
    ... python3 benchmarks/kernel_profile.py --compare     # the tuned winners on 11008x4096 at M = 1 and 16 instead
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmd.turbomind.kernels.w4a16 import default_plan, m_bucket, run_plan  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemm_wt import WtGemmConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemv import GemvConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_layout import quantize_to_engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=11008)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--compare", action="store_true",
                        help="the H200's tuned plans of 11008x4096 at M = 1 (GEMV) and 16 (wt-frag), not --m")
    args = parser.parse_args()
    if args.compare:  # the plans below are the ones tuned for this shape
        args.n, args.k = 11008, 4096
    dev = torch.device("cuda")
    qw, s, z = quantize_to_engine(torch.randn(args.n, args.k, device=dev) * 0.02, args.group, torch.float16)
    runs = [(args.m, default_plan(m_bucket(args.m), args.n, args.k, args.group, dev))]
    if args.compare:
        runs = [(1, GemvConfig(1024, 1, 64, 4, 1, 1)), (16, WtGemmConfig(64, 16, 128, 2, 4, 4, "frag"))]
    for m, plan in runs:
        x = torch.randn(m, args.k, device=dev, dtype=torch.float16)
        print(m, plan.name(), flush=True)
        for _ in range(args.reps):
            run_plan(plan, x, qw, s, z)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
