"""`lmd eval tasks`: the --json shape on a tiny model and a tiny workspace, the table, and the error paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.eval.test_cli import run_main

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "eval").is_dir(), reason="no ../shared/data/eval mirror")


@needs_data
def test_json_shape_hf_and_engine_agree(tiny_llama_ws, monkeypatch, capsys):
    hf_dir, workspace = tiny_llama_ws
    args = ("--tasks", "arc_easy,winogrande,lambada", "--limit", "3", "--data-dir", str(DATA), "--json")
    results = []
    for model in (hf_dir, workspace):
        code, out, err = run_main(monkeypatch, capsys, "eval", "tasks", str(model), *args)
        assert code == 0, err
        results.append(json.loads(out))
    hf, engine = results
    assert set(hf) == {"model", "device", "dtype", "limit", "seconds", "tasks"} and hf["limit"] == 3
    assert engine["model"].endswith("(engine)")
    assert [t["task"] for t in hf["tasks"]] == ["arc_easy", "winogrande", "lambada"]
    arc, wino, lam = hf["tasks"]
    assert arc["items"] == 3 and arc["acc_norm"] is not None and arc["source"].endswith("ARC-Easy-Test.jsonl")
    assert wino["acc_norm"] is None and lam["acc_norm"] is None and lam["ppl"] > 1
    for a, b in zip(hf["tasks"], engine["tasks"], strict=True):
        assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
        assert b["ppl"] == pytest.approx(a["ppl"], rel=1e-4) if a["ppl"] else b["ppl"] is None


@needs_data
def test_table(tiny_llama, monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "eval", "tasks", str(tiny_llama), "--tasks", "piqa",
                              "--limit", "2", "--data-dir", str(DATA))
    assert code == 0, err
    assert "zero-shot accuracy" in out and "piqa" in out and "acc_norm" in out


@pytest.mark.parametrize(("args", "message"), [
    (("--tasks", "arc_easy,mmlu"), "lmd: unknown task mmlu; --tasks takes a comma-separated list of arc_easy"),
    (("--limit", "0"), "lmd: --limit must be at least 1 (got 0)"),
    (("--dtype", "int8"), "lmd: --dtype 'int8' is not supported"),
])
def test_flag_errors_are_one_line(tiny_llama, monkeypatch, capsys, args, message):
    code, out, err = run_main(monkeypatch, capsys, "eval", "tasks", str(tiny_llama), *args)
    assert code == 1 and err.startswith(message) and err.count("\n") == 1


def test_missing_data_is_one_line(tiny_llama, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run_main(monkeypatch, capsys, "eval", "tasks", str(tiny_llama), "--tasks", "hellaswag",
                              "--data-dir", str(tmp_path))
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("lmd: hellaswag: ") and "set --data-dir or LMD_DATA_DIR" in err


def test_missing_model_is_one_line(monkeypatch, capsys, tmp_path):
    code, out, err = run_main(monkeypatch, capsys, "eval", "tasks", str(tmp_path / "nope"))
    assert code == 1 and "does not exist" in err and err.count("\n") == 1
