"""Timing one kernel call as it runs inside a forward pass: cold weights, no launch overhead."""

from __future__ import annotations

from collections.abc import Callable

import torch


def cold_call_ms(fn: Callable[[], object], flush: torch.Tensor, reps: int = 15) -> float:
    """Median GPU time of single calls, each after overwriting `flush` (a buffer larger than L2: cold weights, as in
    a forward pass). A spin kernel keeps the GPU busy while the host launches, so launch overhead stays out, as it
    does in CUDA-graph replays."""
    fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda._sleep(200_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in times)[reps // 2]
