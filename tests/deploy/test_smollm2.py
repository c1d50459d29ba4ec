"""`lmd deploy hf <SmolLM2 gguf>` on the real model (slow: transformers dequantizes the GGUF on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmd.deploy.workspace_reader import load_rank_tensors, read_workspace_config


@pytest.mark.slow
def test_deploy_smollm2_gguf(smollm2_gguf, tmp_path):
    ws = tmp_path / "ws"
    run = subprocess.run([sys.executable, "-m", "lmd", "deploy", "hf", str(smollm2_gguf), "--dst-path", str(ws),
                          "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["model_format"] == "gguf"
    cfg = read_workspace_config(ws)
    assert (cfg.head_num, cfg.kv_head_num, cfg.size_per_head, cfg.num_layer) == (9, 3, 64, 30)
    assert (cfg.rope_theta, cfg.tie_word_embeddings, cfg.end_id, cfg.session_len) == (100000.0, 1, (2,), 8192)
    assert cfg.weight_type == "fp16"
    tensors = load_rank_tensors(ws, 0)
    assert "output.weight" not in tensors
    assert tensors["layers.29.attention.w_qkv.weight"].shape == ((9 + 2 * 3) * 64, 576)
    assert tensors["layers.0.feed_forward.w13.weight"].shape == (2 * 1536, 576)
    assert (ws / "triton_models" / "tokenizer" / "tokenizer.json").is_file()
