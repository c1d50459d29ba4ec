"""The W4A16 tuner's timer setting, and how many weight copies make a graph's calls find cold weights."""

import pytest

from lmd.turbomind.kernels import gpu_timing, w4a16_timer


@pytest.fixture(autouse=True)
def fresh_setting():
    w4a16_timer.tune_timer.cache_clear()
    yield
    w4a16_timer.tune_timer.cache_clear()


@pytest.mark.parametrize(("value", "timer"), [(None, "cold"), ("", "cold"), ("cold", "cold"), ("graph", "graph")])
def test_timer_setting(monkeypatch, value, timer):
    if value is None:
        monkeypatch.delenv("LMD_W4A16_TIMER", raising=False)
    else:
        monkeypatch.setenv("LMD_W4A16_TIMER", value)
    assert w4a16_timer.tune_timer() == timer


def test_an_unknown_timer_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("LMD_W4A16_TIMER", "warm")
    with pytest.raises(ValueError, match="LMD_W4A16_TIMER='warm': expected one of cold, graph"):
        w4a16_timer.tune_timer()


def test_suffix_keeps_the_default_names():
    assert w4a16_timer.timer_suffix("cold") == ""
    assert w4a16_timer.timer_suffix("graph") == ".graph"


@pytest.mark.parametrize(("set_bytes", "l2"), [(45 << 20, 50 << 20), (8 << 20, 50 << 20), (200 << 20, 50 << 20),
                                                (50 << 20, 50 << 20)])
def test_copies_exceed_twice_the_l2(set_bytes, l2):
    copies = gpu_timing.copies_for(set_bytes, l2)
    assert copies * set_bytes > 2 * l2
    assert (copies - 1) * set_bytes <= 2 * l2  # no more than needed
