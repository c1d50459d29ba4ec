"""benchmarks/multi_gpu.py --tiny on CPU (gloo): the multi-GPU script's token check, latency runs and all-reduce
timing, end to end, and the layouts it refuses."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def script():
    """Imported by its name from benchmarks/ (on sys.path, which spawned ranks inherit): the all-reduce ranks are
    started by torch.multiprocessing, which pickles their function by module and name."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("multi_gpu")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_tiny_run_checks_tokens_times_layouts_and_all_reduces(script, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks: up to 2 processes a layout
    script.main(["--tiny", "--layouts", "2x1,1x2,4x1", "--check-prompts", "3", "--iters", "1", "--warmup", "0",
                 "--reps", "3"])
    results = json.loads((tmp_path / "multi_gpu.json").read_text())
    layouts = results["shapes"]["tiny"]["layouts"]
    assert list(layouts) == ["1x1", "2x1", "1x2", "4x1", "2x1 eager"]  # 1x1 first: the tokens' reference
    assert "--tp 4 does not divide head_num=4, kv_head_num=2" in layouts["4x1"]["skipped"]
    for label in ("1x1", "2x1", "1x2", "2x1 eager"):
        r = layouts[label]
        assert r["first_difference"] is None and len(r["tokens"]) == 3 and all(len(t) == 6 for t in r["tokens"])
        assert set(r["decode_ms"]) == {"1", "2"} and all(ms > 0 for ms in r["decode_ms"].values())
    assert layouts["2x1"]["tokens"] == layouts["1x1"]["tokens"]
    assert not any(layouts[label]["decode_graphs"] for label in ("1x1", "2x1", "2x1 eager"))  # none on a CPU
    timings = results["all_reduce"]["2"]["tiny"]
    assert set(timings["us"]) == {"layer batch 1", "layer batch 2", "1 MiB", "4 MiB"}
    assert all(v > 0 for v in timings["us"].values()) and all(v > 0 for v in timings["bus_gb_s"].values())
    out = capsys.readouterr().out
    assert "      2x1     no        identical" in out and "2x1 eager" in out and "busbw" in out


def test_first_difference_names_prompt_and_token(script):
    assert script.first_difference([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) is None
    assert script.first_difference([[1, 2, 3], [4, 6]], [[1, 2, 3], [4, 5]]) == [1, 1]
    assert script.first_difference([[1, 2]], [[1, 2, 3]]) == [0, 2]


def test_bad_flags_are_one_line_errors(script):
    with pytest.raises(SystemExit, match="TPxPP"):
        script.parse_args(["--layouts", "2-1"])
    with pytest.raises(SystemExit, match="one of 7b, 13b, 70b"):
        script.parse_args(["--shapes", "7b,tiny"])
    assert script.fits(script.SHAPES["70b"], 8, 1) is None and "layers" in script.fits(script.SHAPES["tiny"], 1, 3)
