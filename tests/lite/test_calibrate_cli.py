"""`lmd calibrate` / `lmd kv-qparams` end to end: CLI outputs, atomic work dir, deploy -> calibrate -> kv-qparams."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmd.errors import LmdError
from lmd.lite.calibrate import STATS_FILES, CalibrateConfig, calibrate
from lmd.lite.kv_qparams import KVQParamsConfig, export_kv_qparams

WIKI = Path(os.environ["LMD_DATA_DIR"]) / "wikitext-2-raw" / "wiki.valid.raw"


def _lmd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmd", *args], capture_output=True, text=True, env=os.environ)


@pytest.fixture(scope="module")
def calib_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text(WIKI.read_text(encoding="utf-8")[:40_000])
    return path


def test_cli_calibrate_then_kv_qparams(tiny_llama, calib_text, tmp_path):
    work = tmp_path / "work"
    run = _lmd("calibrate", str(tiny_llama), "--calib-dataset", str(calib_text), "--calib-samples", "3",
               "--calib-seqlen", "32", "--batch-size", "2", "--work-dir", str(work), "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert (result["samples"], result["seqlen"], result["num_layers"], result["kv_heads"]) == (3, 32, 2, 2)
    assert sorted(p.name for p in work.iterdir()) == sorted([*STATS_FILES, "calib.json"])
    calib = json.loads((work / "calib.json").read_text())
    for key in ("model", "dataset", "split", "samples", "seqlen", "seed", "lmd_version", "device", "seconds"):
        assert key in calib
    assert [p.name for p in tmp_path.iterdir()] == ["work"]  # no temp dir left behind

    again = _lmd("calibrate", str(tiny_llama), "--calib-dataset", str(calib_text), "--work-dir", str(work))
    assert again.returncode == 1
    assert again.stderr.strip().count("\n") == 0 and "--force" in again.stderr and "Traceback" not in again.stderr

    weights = tmp_path / "ws" / "triton_models" / "weights"
    weights.mkdir(parents=True)
    (weights / "config.ini").write_text("[llama]\ntensor_para_size = 1\nhead_num = 4\nkv_head_num = 2\n"
                                        "size_per_head = 32\nnum_layer = 2\n")
    mismatch = _lmd("kv-qparams", str(work), str(weights), "--num-tp", "2")
    assert mismatch.returncode == 1 and "tensor_para_size=1" in mismatch.stderr
    ok = _lmd("kv-qparams", str(work), str(tmp_path / "ws"), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["files"] == [str((weights / "kv_qparams.rank0.safetensors").resolve())]


def test_calibrate_failure_leaves_no_output(tiny_llama, calib_text, tmp_path):
    work = tmp_path / "work"
    with pytest.raises(LmdError, match="too few"):
        calibrate(CalibrateConfig(model=str(tiny_llama), work_dir=str(work), calib_dataset=str(calib_text),
                                  calib_samples=2, calib_seqlen=100_000))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(LmdError, match="--batch-size"):
        CalibrateConfig(model="m", work_dir=str(work), batch_size=0)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "phi3"])
def test_deploy_calibrate_kv_qparams_engine_reads_them(tmp_path, calib_text, model_type):
    converter = pytest.importorskip("lmd.deploy.converter")
    workspace_mod = pytest.importorskip("lmd.turbomind.workspace")
    from tests.conftest import build_tiny_model

    model = build_tiny_model(tmp_path / "model", model_type)
    work = tmp_path / "work"
    calibrate(CalibrateConfig(model=str(model), work_dir=str(work), calib_dataset=str(calib_text), calib_samples=2,
                              calib_seqlen=32))
    key_stats = torch.load(work / "key_stats.pth")
    for tp, granularity in ((1, "head"), (2, "head"), (2, "channel")):
        ws = converter.deploy("hf", str(model), str(tmp_path / f"ws{tp}{granularity}"), tp=tp, dtype="float32",
                              progress=False)
        export_kv_qparams(KVQParamsConfig(str(work), str(ws), num_tp=tp, granularity=granularity))
        weights = Path(ws) / "triton_models" / "weights"
        assert sorted(p.name for p in weights.glob("kv_qparams*")) == [f"kv_qparams.rank{r}.safetensors"
                                                                       for r in range(tp)]
        # the engine runs every rank in one process: it reads all rank files back as one whole-model tensor per layer
        params = workspace_mod.open_workspace(ws).load_kv_qparams("cpu")
        hi, lo = key_stats["max"]["model.layers.1"], key_stats["min"]["model.layers.1"]  # [kv heads, head dim]
        if granularity == "head":
            hi, lo = hi.amax(-1), lo.amin(-1)
        assert params is not None and params["layers.1.k_scale"].shape == (hi.numel(),)
        torch.testing.assert_close(params["layers.1.k_zero"], ((hi + lo) / 2).reshape(-1))
        torch.testing.assert_close(params["layers.1.k_scale"], ((hi - lo) / 255).reshape(-1))
