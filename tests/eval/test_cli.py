"""`lmd eval ppl`: a real run on a tiny model (JSON and table) and every error path as one line, exit 1."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from lmd.calib_data import load_eval_text
from lmd.calib_data.tokenization import encode


def run_lmd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmd", *args], capture_output=True, text=True, timeout=300)


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run the real `lmd` entry point in-process (what the console script calls): exit code, stdout, stderr."""
    from lmd.cli import main

    monkeypatch.setattr(sys, "argv", ["lmd", *args])
    monkeypatch.setenv("COLUMNS", "200")
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_result_matches_a_direct_hf_computation(tiny_llama, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    code, out, err = run_main(monkeypatch, capsys, "eval", "ppl", str(tiny_llama), "--dataset", "pydoc",
                              "--seqlen", "64", "--max-windows", "2", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert {k: result[k] for k in ("dataset", "split", "seqlen", "windows", "tokens")} == {
        "dataset": "pydoc", "split": "test", "seqlen": 64, "windows": 2, "tokens": 126}
    assert "pydoc_data" in result["source"] and result["model"] == str(tiny_llama.resolve())

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    ids = encode(AutoTokenizer.from_pretrained(tiny_llama), load_eval_text("pydoc", "test").text)
    with torch.no_grad():
        losses = [model(input_ids=ids[i * 64:(i + 1) * 64][None], labels=ids[i * 64:(i + 1) * 64][None]).loss
                  for i in range(2)]
    assert result["ppl"] == pytest.approx(math.exp(torch.stack(losses).mean().item()), rel=1e-4)


def test_table_output_names_the_data(tiny_llama, tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Perplexity measures how surprised a model is by text. " * 40, encoding="utf-8")
    code, out, err = run_main(monkeypatch, capsys, "eval", "ppl", str(tiny_llama), "--dataset", str(corpus),
                              "--seqlen", "32", "--max-windows", "1")
    assert code == 0, err
    for word in ("ppl", "windows", "seconds", f"file {corpus.resolve()}", str(tiny_llama.resolve())):
        assert word in out


@pytest.fixture
def broken_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize(("args", "message"), [
    (["/nonexistent/model"], "model path /nonexistent/model does not exist"),
    (["{tiny}", "--dataset", "wikitext3"], "unknown dataset 'wikitext3'; use one of wikitext2, ptb, c4, pileval, pydoc"),
    (["{tiny}", "--seqlen", "1"], "--seqlen must be at least 2"),
    (["{tiny}", "--max-windows", "0"], "--max-windows must be at least 1"),
    (["{tiny}", "--dtype", "int3"], "--dtype 'int3' is not supported"),
    (["{tiny}", "--device", "tpu"], "unknown device 'tpu'"),
    (["{tiny}", "--split", "dev"], "unknown split 'dev'"),
    (["{broken}", "--dataset", "pydoc"], "cannot read the config of"),
])
def test_errors_are_one_line_without_traceback(tiny_llama, broken_config, monkeypatch, capsys, args, message):
    args = [a.replace("{tiny}", str(tiny_llama)).replace("{broken}", str(broken_config)) for a in args]
    monkeypatch.delenv("LMD_DEBUG", raising=False)
    code, out, err = run_main(monkeypatch, capsys, "eval", "ppl", *args)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("lmd: ") and message in lines[0]
    assert "Traceback" not in err


def test_console_command_exits_1_with_one_line(tmp_path):
    proc = run_lmd("eval", "ppl", str(tmp_path / "missing.gguf"))
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"lmd: model path {tmp_path / 'missing.gguf'} does not exist; give ")
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
