"""The skinny GEMM's in-kernel split-K join on a GPU (`kernels/dense_mma.py`): for each case, the joined output
equals the split-sum kernel's bit for bit, 30 calls captured in one CUDA graph (PDL on, each call joining on the
same counters) and replayed 30 times give the same bits every time, and the counters are all zero afterwards.

    python3 benchmarks/gpu_dense_join_check.py

Prints one line per case and exits 1 on any failure. Writes $OUT/gpu_dense_join_check.json when OUT is set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lmd.turbomind.kernels import dense_mma as dm  # noqa: E402

# (rows, N, K, split-K, descriptors): the 7B decode shapes, uneven K slices, more splits than key tiles need
CASES = ((1, 4096, 4096, 4, False), (64, 11008, 4096, 3, True), (16, 4096, 11008, 8, True),
         (200, 128, 4096, 16, False), (3, 1000, 777, 5, False), (64, 4096, 4096, 2, True))


def check(m: int, n: int, k: int, split: int, tma: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=g) * 0.05
    b = torch.randn(n, device="cuda", dtype=torch.float16, generator=g)
    config = dm.DenseMmaConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, split_k=split, tma=tma)
    joined = dm.dense_mma(x, w, b, config)
    limit, dm.MAX_JOIN_TILES = dm.MAX_JOIN_TILES, 0
    try:
        summed = dm.dense_mma(x, w, b, config)
    finally:
        dm.MAX_JOIN_TILES = limit
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [dm.dense_mma(x, w, b, config) for _ in range(30)]
    repeats = True
    for _ in range(30):
        graph.replay()
        torch.cuda.synchronize()
        repeats &= all(torch.equal(y, joined) for y in outs)
    counters = int(dm._join_counters(x.device).abs().sum().item())
    ok = torch.equal(joined, summed) and repeats and counters == 0
    row = dict(m=m, n=n, k=k, split=split, tma=tma, same_as_split_sum=torch.equal(joined, summed),
               graph_repeats=repeats, counters_left=counters, ok=ok)
    print(f"{'ok  ' if ok else 'FAIL'} M {m:3d} N {n:5d} K {k:5d} split {split:2d} tma {tma!s:5s}: same as the "
          f"split-sum kernel {row['same_as_split_sum']}, graph replays repeat {repeats}, counters left {counters}",
          flush=True)
    return row


def main() -> int:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    rows = [check(*case) for case in CASES]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_dense_join_check.json").write_text(json.dumps(rows, indent=1))
    failures = sum(not r["ok"] for r in rows)
    print(f"{len(rows)} cases, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
