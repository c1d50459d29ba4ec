"""`lmd eval ppl ./workspace` scores through the engine and agrees with `lmd eval ppl` of the source HF model."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from lmd.cli import app


def _ppl(model, text_file) -> dict:
    result = CliRunner().invoke(app, ["eval", "ppl", str(model), "--dataset", str(text_file), "--seqlen", "48",
                                      "--max-windows", "2", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def test_workspace_ppl_matches_the_hf_model(tiny_llama_ws, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    src, ws = tiny_llama_ws
    ours, ref = _ppl(ws, text), _ppl(src, text)
    assert "(engine)" in ours["model"] and ours["windows"] == ref["windows"] == 2
    assert abs(ours["ppl"] - ref["ppl"]) < 1e-4 * ref["ppl"]
