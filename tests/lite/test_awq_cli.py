"""`lmd awq` through the real CLI: a tiny model end to end, and every user error as one line without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import build_tiny_model

WIKI = Path(os.environ["LMD_DATA_DIR"]) / "wikitext-2-raw" / "wiki.valid.raw"


def _lmd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmd", "awq", *args], capture_output=True, text=True, env=os.environ)


@pytest.fixture(scope="module")
def calib_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text(WIKI.read_text(encoding="utf-8")[:30_000])
    return path


def test_cli_writes_an_awq_directory_and_reports_ppl(tiny_llama, calib_text, tmp_path):
    out = tmp_path / "awq"
    run = _lmd(
        str(tiny_llama),
        "--work-dir",
        str(out),
        "--w-group-size",
        "32",
        "--calib-dataset",
        str(calib_text),
        "--calib-samples",
        "4",
        "--calib-seqlen",
        "64",
        "--batch-size",
        "2",
        "--eval-dataset",
        str(calib_text),
        "--eval-windows",
        "1",
        "--eval-seqlen",
        "128",
        "--eval-tasks",
        "arc_easy,piqa",
        "--eval-items",
        "8",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    # the default method, awq-gptq
    assert report["method"] == "awq+gptq" and report["group_size"] == 32 and report["calib_samples"] == 4
    assert report["int4_ppl"] > 0 and report["fp_ppl"] > 0 and report["eval_windows"] == 1
    # the accuracy line: both models scored on the first 8 items of each task, as fractions of 8
    assert report["eval_items"] == 8 and set(report["fp_acc"]) == set(report["int4_acc"]) == {"arc_easy", "piqa"}
    assert all(0 <= 8 * a == round(8 * a) <= 8 for a in [*report["fp_acc"].values(), *report["int4_acc"].values()])
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 32
    assert json.loads((out / "lmd_awq.json").read_text())["calib_seqlen"] == 64
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left behind

    again = _lmd(str(tiny_llama), "--work-dir", str(out), "--w-group-size", "32", "--no-eval")
    assert again.returncode == 1 and "--force" in again.stderr and "Traceback" not in again.stderr


def test_group_size_error_names_the_layer_and_the_fitting_sizes(tmp_path, calib_text):
    model = build_tiny_model(tmp_path / "m", "llama", hidden_size=96, intermediate_size=192)
    run = _lmd(
        str(model),
        "--work-dir",
        str(tmp_path / "out"),
        "--w-group-size",
        "64",
        "--no-eval",
        "--calib-dataset",
        str(calib_text),
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "model.layers.0.self_attn.q_proj has 96 input channels" in run.stderr
    assert "--w-group-size 32" in run.stderr
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    run = _lmd(str(model), "--work-dir", str(tmp_path / "out"))
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "'gpt2' is not supported" in run.stderr and "internlm3, llama, mistral, phi3, qwen2, qwen3" in run.stderr


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--w-bits", "8"], "--w-bits 8"),
        (["--w-group-size", "96"], "--w-group-size 96"),
        (["--duo-scaling", "sometimes"], "--duo-scaling"),
        (["--asym-clip", "--no-clip"], "--asym-clip"),
        (["--method", "omni"], "--method 'omni' is not valid"),
        (["--method", "autoround", "--gptq"], "--method autoround"),
        (["--method", "autoround", "--autoround-iters", "0"], "--autoround-iters 0"),
        (["--method", "awq", "--autoround-batch", "4"], "apply to --method autoround only"),
    ],
)
def test_bad_flags_fail_before_loading_anything(tmp_path, flags, message):
    run = _lmd(str(tmp_path / "does-not-matter"), "--work-dir", str(tmp_path / "out"), *flags)
    assert run.returncode == 1 and message in run.stderr and "Traceback" not in run.stderr


def test_bad_eval_tasks_fail_before_the_model_loads(tmp_path):
    out = tmp_path / "out"
    run = _lmd(str(tmp_path / "no-model"), "--work-dir", str(out), "--eval-tasks", "arc_easy,mmlu")
    assert run.returncode == 1 and "unknown task mmlu" in run.stderr and "Traceback" not in run.stderr
    run = _lmd(str(tmp_path / "no-model"), "--work-dir", str(out), "--eval-items", "0")
    assert run.returncode == 1 and "--eval-items 0" in run.stderr and "--no-eval" in run.stderr


def test_plain_text_report_has_the_accuracy_line(tiny_llama, calib_text, tmp_path):
    run = _lmd(str(tiny_llama), "--work-dir", str(tmp_path / "out"), "--w-group-size", "32", "--method", "rtn",
               "--eval-dataset", str(calib_text), "--eval-windows", "1", "--eval-seqlen", "128",
               "--eval-tasks", "piqa", "--eval-items", "4")
    assert run.returncode == 0, run.stderr
    assert "accuracy, first 4" in run.stdout and "piqa" in run.stdout and "->" in run.stdout
    assert "rtn" in run.stdout


def test_no_eval_skips_the_accuracy_line(tiny_llama, tmp_path):
    run = _lmd(str(tiny_llama), "--work-dir", str(tmp_path / "out"), "--w-group-size", "32", "--method", "rtn",
               "--no-eval", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert "int4_acc" not in report and "fp_acc" not in report and "int4_ppl" not in report


def test_cli_defaults_are_the_config_defaults():
    import inspect

    from lmd.lite.awq import AwqConfig
    from lmd.lite.cli_awq import awq_command

    params = inspect.signature(awq_command).parameters
    config = AwqConfig()
    for flag, field in (
        ("w_bits", "w_bits"),
        ("w_group_size", "group_size"),
        ("duo_scaling", "duo_scaling"),
        ("search_tokens", "search_tokens"),
        ("batch_size", "batch_size"),
        ("device", "device"),
        ("asym_clip", "asym_clip"),
        ("refine_scale", "refine_scale"),
        ("gptq", "gptq"),
        ("quantized_inputs", "quantized_inputs"),
    ):
        assert params[flag].default.default == getattr(config, field), flag


def test_cli_default_method_is_the_chosen_one():
    import inspect

    from lmd.lite.awq import AwqConfig
    from lmd.lite.awq_methods import DEFAULT_METHOD, METHODS
    from lmd.lite.cli_awq import awq_command

    params = inspect.signature(awq_command).parameters
    assert params["method"].default.default == DEFAULT_METHOD in METHODS
    config = AwqConfig()  # --autoround-* default to None (refused outside autoround); their help names the defaults
    assert f"default {config.sign_round_iters})" in params["autoround_iters"].default.help
    assert f"default {config.sign_round_batch})" in params["autoround_batch"].default.help
