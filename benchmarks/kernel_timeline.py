"""Where a stream of GPU kernels leaves the GPU idle: the span of a profiled run, the time at least one kernel runs
(the union of their intervals: under programmatic dependent launch a kernel starts before its predecessor ends, so
durations overlap and their sum overstates the work), and the idle gaps, each charged to the transition
(the kernel that ended last, the kernel that starts after the gap). Used by decode_step_kernels.py on graph replays.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Timeline:
    span_us: float  # first start to last end
    busy_us: float  # at least one kernel running
    idle_us: float  # span - busy
    gaps_us: dict[tuple[str, str], float]  # (ended last, starts next) -> idle time before the next, largest first
    gap_counts: dict[tuple[str, str], int]


def timeline(kernels: list[tuple[str, float, float]]) -> Timeline:
    """kernels: (name, start, end) in µs, any order."""
    if not kernels:
        return Timeline(0.0, 0.0, 0.0, {}, {})
    ordered = sorted(kernels, key=lambda k: (k[1], k[2]))
    gaps: dict[tuple[str, str], float] = defaultdict(float)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    busy = 0.0
    last_name, run_start, run_end = ordered[0]
    for name, start, end in ordered[1:]:
        if start > run_end:  # idle until this kernel
            gaps[(last_name, name)] += start - run_end
            counts[(last_name, name)] += 1
            busy += run_end - run_start
            run_start, run_end, last_name = start, end, name
        elif end > run_end:
            run_end, last_name = end, name
    busy += run_end - run_start
    span = max(k[2] for k in ordered) - ordered[0][1]
    order = sorted(gaps, key=lambda key: -gaps[key])
    return Timeline(span, busy, span - busy, {k: gaps[k] for k in order}, {k: counts[k] for k in order})
