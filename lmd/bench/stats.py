"""Percentiles and summaries of latency samples (pure Python, so the CLI needs no numpy at import time)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q} is outside [0, 100]")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Summary:
    count: int
    mean: float
    median: float
    p90: float
    p99: float
    min: float
    max: float

    def scaled(self, factor: float) -> Summary:
        """The same summary in another unit (e.g. seconds -> milliseconds); count stays."""
        return Summary(self.count, *(getattr(self, k) * factor for k in ("mean", "median", "p90", "p99", "min", "max")))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def summarize(values: Sequence[float]) -> Summary | None:
    """Summary of the samples; None when there are none (e.g. TPOT when every request produced one token)."""
    if not values:
        return None
    return Summary(
        len(values),
        statistics.fmean(values),
        statistics.median(values),
        percentile(values, 90),
        percentile(values, 99),
        min(values),
        max(values),
    )
