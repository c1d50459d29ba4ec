"""benchmarks/speculative_cpu.py's accounting: the agreement with plain decoding and the per-set summary."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "speculative_cpu.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("speculative_cpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_same_prefix_counts_leading_agreement(script):
    assert script.same_prefix([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert script.same_prefix([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert script.same_prefix([7], [1, 2]) == 0
    assert script.same_prefix([1, 2], [1, 2, 3]) == 2  # a shorter output agrees as far as it goes


def row(tokens: int, plain_cpu: float, spec_cpu: float, identical: bool, prefix: int, proposed: int, accepted: int,
        verifications: int, steps: int) -> dict:
    label = "ngram-k4"
    return {"tokens": tokens, "plain_s": plain_cpu, "plain_cpu_s": plain_cpu, "plain_steps": tokens,
            f"{label}_identical": identical, f"{label}_same_prefix": prefix, f"{label}_s": spec_cpu,
            f"{label}_cpu_s": spec_cpu, f"{label}_steps": steps, f"{label}_proposed": proposed,
            f"{label}_accepted": accepted, f"{label}_verifications": verifications}


def test_summarise_totals_over_prompts(script):
    rows = [row(100, 4.0, 2.0, True, 100, 60, 40, 20, 50), row(50, 2.0, 2.0, False, 25, 10, 0, 10, 50)]
    s = script.summarise(rows, "ngram-k4")
    assert s["identical"] is False and s["identical_prompts"] == 1
    assert s["same_prefix_share"] == pytest.approx(125 / 150)
    assert s["cpu_speedup"] == pytest.approx(6.0 / 4.0)  # totals, not a mean of per-prompt ratios
    assert s["worst_prompt_cpu_speedup"] == pytest.approx(1.0)
    assert s["steps_ratio"] == pytest.approx(150 / 100)
    assert s["acceptance"] == pytest.approx(40 / 70)
    assert s["mean_accepted_length"] == pytest.approx(1 + 40 / 30)
