import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from kernel_timeline import timeline  # noqa: E402


def test_overlapping_kernels_count_once_and_gaps_go_to_their_transition():
    t = timeline([("b", 5.0, 12.0), ("a", 0.0, 10.0),  # b starts under a (PDL): no gap, b ends last
                  ("c", 15.0, 20.0),  # 3 µs idle after b
                  ("d", 20.0, 21.0), ("c", 25.0, 26.0)])  # d follows c at once, then 4 µs idle
    assert t.span_us == 26.0
    assert t.busy_us == pytest.approx(12.0 + 6.0 + 1.0)
    assert t.idle_us == pytest.approx(7.0)
    assert list(t.gaps_us.items()) == [(("d", "c"), 4.0), (("b", "c"), 3.0)]
    assert t.gap_counts == {("d", "c"): 1, ("b", "c"): 1}


def test_a_kernel_inside_another_leaves_the_longer_as_the_last_to_end():
    t = timeline([("long", 0.0, 10.0), ("short", 1.0, 2.0), ("next", 11.0, 12.0)])
    assert t.gaps_us == {("long", "next"): 1.0}
    assert t.busy_us == 11.0


def test_empty():
    assert timeline([]).span_us == 0.0
