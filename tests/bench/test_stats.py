"""Percentiles and summaries against numpy / statistics on known inputs."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest

from lmd.bench.stats import percentile, summarize


@pytest.mark.parametrize(
    "values",
    [
        [3.0],
        [1.0, 2.0],
        [5.0, 1.0, 4.0, 2.0, 3.0],
        [0.5, 0.5, 0.5, 9.0],
        [random.Random(s).expovariate(1.0) for s in range(101)],
    ],
)
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_matches_numpy_linear(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-12)


def test_percentile_known_values():
    values = list(range(1, 11))  # 1..10: rank (n-1)q/100
    assert percentile(values, 50) == 5.5
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 10


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_matches_statistics_and_numpy():
    values = [random.Random(7).gauss(10, 3) for _ in range(57)]
    s = summarize(values)
    assert s.count == 57
    assert s.mean == pytest.approx(statistics.fmean(values))
    assert s.median == pytest.approx(statistics.median(values))
    assert s.p90 == pytest.approx(np.percentile(values, 90))
    assert s.p99 == pytest.approx(np.percentile(values, 99))
    assert (s.min, s.max) == (min(values), max(values))
    ms = s.scaled(1000)
    assert ms.count == 57 and ms.p99 == pytest.approx(1000 * s.p99) and ms.min == pytest.approx(1000 * s.min)
    assert summarize([]) is None
