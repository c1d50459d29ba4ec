"""Host time of one `F.linear` call on the GPU when the token count is new each call, against a count seen before
(issue 14: eager mixed steps of a serving run spent ~0.2 ms of host time per linear; the suspect is cuBLAS choosing
an algorithm for every new shape). A CUDA machine.

    python3 benchmarks/linear_host_cost.py [--shape llama3-8b] [--calls 200]

For each of the shape's four linears: `--calls` calls whose row count M is new each time (M = 300, 301, ...), the
same calls with M rounded up to a multiple of 64 (the engine's padding of eager steps), and M fixed; each call timed on
the host with the GPU idle before it (synchronized), median per call. Writes $OUT/linear_host_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"llama3-8b": {"qkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336)},
          "llama2-7b": {"qkv": (12288, 4096), "wo": (4096, 4096), "w13": (22016, 4096), "w2": (4096, 11008)}}


def host_us(weight: torch.Tensor, x: torch.Tensor, rows: list[int]) -> float:
    times = []
    for m in rows:
        torch.cuda.synchronize()
        t = time.perf_counter()
        F.linear(x[:m], weight)
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=tuple(SHAPES))
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--first-m", type=int, default=300)
    args = p.parse_args()
    results = {}
    print(f"{'linear':<8} {'new M each call us':>18} {'M padded to 64 us':>18} {'fixed M us':>11}")
    for name, (n, k) in SHAPES[args.shape].items():
        weight = torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02
        x = torch.randn(args.first_m + 2 * args.calls + 64, k, dtype=torch.float16, device="cuda")
        new = list(range(args.first_m, args.first_m + args.calls))
        padded = [-(-m // 64) * 64 for m in range(args.first_m + args.calls, args.first_m + 2 * args.calls)]
        host_us(weight, x, padded[:1] * 3)  # cuBLAS handle and workspace
        row = {"new_m_us": host_us(weight, x, new), "padded_m_us": host_us(weight, x, padded),
               "fixed_m_us": host_us(weight, x, [args.first_m] * args.calls)}
        results[name] = row
        print(f"{name:<8} {row['new_m_us']:>18.1f} {row['padded_m_us']:>18.1f} {row['fixed_m_us']:>11.1f}")
    Path(os.environ.get("OUT", "."), "linear_host_cost.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
