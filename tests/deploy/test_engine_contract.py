"""Workspaces written by deploy pass the engine's own loader checks (lmd/turbomind reads nothing else)."""

from __future__ import annotations

import pytest

from lmd.deploy import deploy


@pytest.mark.parametrize("kind", ["qwen2-fp16", "llama-int4"])
def test_engine_accepts_every_rank(tiny_models, tiny_awq, tmp_path, kind):
    from lmd.turbomind.weights import check_weights
    from lmd.turbomind.workspace import open_workspace

    if kind == "qwen2-fp16":
        ws = deploy("qwen", str(tiny_models("qwen2")), str(tmp_path / "ws"), tp=2, progress=False)
    else:
        ws = deploy("hf", str(tiny_awq("llama", 32)), str(tmp_path / "ws"), group_size=32, tp=2, progress=False)
    for rank in range(2):  # each rank file as deployed, and the whole model merged from them (tp 1)
        workspace = open_workspace(ws, tp=2, tp_rank=rank)
        check_weights(workspace.model, workspace.load_weights("cpu"), str(workspace.weights_file()))
    whole = open_workspace(ws)
    check_weights(whole.rank_model, whole.load_weights("cpu"), str(whole.weights_dir))
    assert workspace.chat_template().name in ("qwen", "hf")
    assert workspace.load_tokenizer().vocab_size == 49152
