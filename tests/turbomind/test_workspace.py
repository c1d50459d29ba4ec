"""Workspace loading: config.ini + overrides, and one clear LmdError for anything missing or inconsistent."""

from __future__ import annotations

import shutil

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.model_runner import ModelRunner
from lmd.turbomind.workspace import open_workspace


def _copy(tiny_llama_ws, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(tiny_llama_ws[1], ws)
    return ws


def _edit_ini(ws, key, value):
    path = ws / "triton_models/weights/config.ini"
    lines = [f"{key} = {value}" if line.split("=")[0].strip() == key else line
             for line in path.read_text().splitlines()]
    path.write_text("\n".join(lines) + "\n")


def test_config_ini_and_overrides(tiny_llama_ws):
    ws = open_workspace(tiny_llama_ws[1], max_batch_size=3, quant_policy=4)
    assert ws.model.head_num == 4 and ws.model.kv_head_num == 2 and ws.model.weight_type == "fp32"
    assert ws.engine.max_batch_size == 3 and ws.engine.quant_policy == 4
    assert open_workspace(tiny_llama_ws[1]).engine.max_batch_size == 64  # the override did not stick


def test_hand_edited_serving_keys_are_honoured(tiny_llama_ws, tmp_path):
    ws = _copy(tiny_llama_ws, tmp_path)
    _edit_ini(ws, "cache_block_seq_len", "8")
    _edit_ini(ws, "cache_max_entry_count", "10")
    runner = ModelRunner(open_workspace(ws))
    assert runner.block_size == 8 and runner.num_blocks == 10


@pytest.mark.parametrize("options, message", [
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"quant_policy": 8}, "quant_policy"),
    ({"no_such_option": 1}, "unknown engine option"),
])
def test_bad_options_are_refused(tiny_llama_ws, options, message):
    with pytest.raises(LmdError, match=message):
        open_workspace(tiny_llama_ws[1], **options)


def test_missing_pieces_are_named(tiny_llama_ws, tmp_path):
    with pytest.raises(LmdError, match="does not exist"):
        open_workspace(tmp_path / "nope")
    ws = _copy(tiny_llama_ws, tmp_path)
    (ws / "triton_models/weights/model.rank0.safetensors").unlink()
    with pytest.raises(LmdError, match="model.rank0.safetensors not found"):
        ModelRunner(open_workspace(ws))
    (ws / "triton_models/weights/config.ini").unlink()
    with pytest.raises(LmdError, match="config.ini not found"):
        open_workspace(ws)


def test_config_and_weights_that_disagree(tiny_llama_ws, tmp_path):
    from safetensors.torch import load_file, save_file

    ws = _copy(tiny_llama_ws, tmp_path)
    _edit_ini(ws, "head_num", "3")
    with pytest.raises(LmdError, match="head_num=3 is not a multiple of kv_head_num=2"):
        open_workspace(ws)
    _edit_ini(ws, "head_num", "4")
    path = ws / "triton_models/weights/model.rank0.safetensors"
    tensors = load_file(str(path))
    tensors["layers.1.feed_forward.w2.weight"] = torch.zeros(128, 100)
    del tensors["layers.0.attention_norm.weight"]
    save_file(tensors, str(path))
    with pytest.raises(LmdError, match="layers.0.attention_norm.weight is missing"):
        ModelRunner(open_workspace(ws))
