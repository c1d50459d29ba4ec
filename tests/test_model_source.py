from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmd.errors import LmdError
from lmd.model_source import load_causal_lm, load_config, resolve_model, torch_dtype


def test_hf_dir_resolves_and_loads(tiny_llama: Path) -> None:
    source = resolve_model(tiny_llama)
    assert not source.is_gguf and source.name_or_dir == str(tiny_llama.resolve())
    model = load_causal_lm(source, dtype="float16")
    assert next(model.parameters()).dtype == torch.float16
    assert load_config(source).num_hidden_layers == 2


def test_gguf_file_and_dir_with_one_gguf(smollm2_gguf: Path) -> None:
    by_file = resolve_model(smollm2_gguf)
    assert by_file.is_gguf and by_file.gguf_file == smollm2_gguf.name
    assert resolve_model(smollm2_gguf.parent).gguf_file == smollm2_gguf.name
    assert load_config(by_file).hidden_size == 576


@pytest.mark.parametrize(("arg", "message"), [
    ("/nonexistent/model.gguf", "does not exist"),
    ("/nonexistent/dir", "does not exist"),
    ("not-a-hub-id", "does not exist"),
])
def test_bad_model_paths_are_one_line_errors(arg: str, message: str) -> None:
    with pytest.raises(LmdError, match=message) as info:
        resolve_model(arg)
    assert "\n" not in str(info.value)


def test_dir_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(LmdError, match="no config.json"):
        resolve_model(tmp_path)


def test_hub_id_is_passed_through() -> None:
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").name_or_dir == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_unknown_dtype() -> None:
    with pytest.raises(LmdError, match="unknown dtype"):
        torch_dtype("int3")


def test_awq_directory_loads_as_its_dequantized_float_model(tiny_llama: Path, tmp_path: Path) -> None:
    from lmd.lite.awq_export import load_awq_as_float
    from lmd.model_source import is_awq_checkpoint

    out = tmp_path / "awq"
    proc = subprocess.run(
        [sys.executable, "-m", "lmd", "awq", str(tiny_llama), "--work-dir", str(out),
         "--w-group-size", "64", "--no-search-scale", "--no-clip", "--no-eval"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    source = resolve_model(out)
    assert is_awq_checkpoint(source) and not is_awq_checkpoint(resolve_model(tiny_llama))
    loaded = load_causal_lm(source)
    reference = load_awq_as_float(out)
    ids = torch.randint(0, 1000, (1, 16))
    torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=0)
    original = load_causal_lm(resolve_model(tiny_llama))
    assert not torch.equal(loaded.model.layers[0].mlp.up_proj.weight, original.model.layers[0].mlp.up_proj.weight)


def test_gguf_dequantization_progress_bar_is_silenced_and_restored(capsys) -> None:
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from lmd.model_source import _quiet_gguf_progress

    original = gguf_utils.tqdm
    with _quiet_gguf_progress():
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
    assert gguf_utils.tqdm is original
    assert "Converting" not in capsys.readouterr().err
