"""How the W4A16 tuner times a candidate, chosen by `LMD_W4A16_TIMER`:

    cold   (default) single calls, each after an L2 flush (`gpu_timing.cold_call_ms`): how the shipped tables
           were tuned;
    graph  as a decode step runs them (`gpu_timing.graph_call_ms`, the skinny dense planner's timing): a CUDA graph
           of calls, each behind an RMSNorm kernel as a projection follows its norm, on weight copies worth more
           than twice the L2, so that a kernel's early start under programmatic dependent launch counts.

Why both: they disagree. At 16 rows on an H100 the cold calls put the Triton `wt-frag` plans ahead of the mma GEMV
(21.3 against 24.1 µs on 12288 x 4096), while calls back to back in a graph over weight copies put the GEMV ahead
(17.6 against 24.3: docs/benchmarks.md, the twenty-third session's probe and the twenty-sixth session's kernels.py).
Only the decode step can say which picks better (`benchmarks/w4a16_mma_gpu_call.sh timer`), so plans tuned one way
are cached and shipped apart from the other's (`timer_suffix`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from lmd.turbomind.kernels.gpu_timing import cold_call_ms, cold_copies, graph_call_ms

TIMERS = ("cold", "graph")
FLUSH_BYTES = 256 << 20  # more than any GPU's L2: the cold timer's flush buffer

WeightSet = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # qweight, scales, zeros
Timer = Callable[[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]], float]


@functools.cache
def tune_timer() -> str:
    """The timer of this process, from LMD_W4A16_TIMER (read once)."""
    timer = os.environ.get("LMD_W4A16_TIMER", "cold") or "cold"
    if timer not in TIMERS:
        raise ValueError(f"LMD_W4A16_TIMER={timer!r}: expected one of {', '.join(TIMERS)}")
    return timer


def timer_suffix(timer: str) -> str:
    """What tells plans tuned by `timer` apart in cache keys and table names: nothing for the default."""
    return "" if timer == "cold" else f".{timer}"


def candidate_timer(x: torch.Tensor, weights: WeightSet, timer: str) -> Timer:
    """A function timing `fn(qweight, scales, zeros)` (ms, the candidate's call on x) the way `timer` says."""
    if timer == "cold":
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=x.device)
        return lambda fn: cold_call_ms(lambda: fn(*weights), flush)
    from lmd.turbomind.kernels.rms_norm import add_rms_norm_triton

    sets = cold_copies(weights)
    norm_weight = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
    return lambda fn: graph_call_ms(lambda w: fn(*w), sets, lambda: add_rms_norm_triton(x, None, norm_weight, 1e-6))
