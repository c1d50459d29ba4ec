from __future__ import annotations

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
