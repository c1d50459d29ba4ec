"""benchmarks/engine.py --tiny on CPU: the GPU script's workspace builder and measurement, end to end."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("engine_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_int4_workspace_is_what_the_engine_reads(script, tmp_path):
    from lmd.turbomind.kernels.w4a16_layout import unpack_codes_along_k
    from lmd.turbomind.workspace import open_workspace

    ws = script.build_workspace(tmp_path / "ws", script.TINY, True, 256, torch.device("cpu"))
    workspace = open_workspace(ws)
    assert (workspace.model.weight_type, workspace.model.group_size, workspace.model.num_layer) == ("int4", 128, 2)
    weights = workspace.load_weights("cpu")
    qkv = weights["layers.0.attention.w_qkv.qweight"]
    tiny = script.TINY
    head_dim = tiny["hidden_size"] // tiny["num_attention_heads"]
    assert qkv.shape == (
        tiny["hidden_size"] // 8,
        (tiny["num_attention_heads"] + 2 * tiny["num_key_value_heads"]) * head_dim,
    )
    codes = unpack_codes_along_k(qkv)
    assert codes.min() == 0 and codes.max() == 15 and abs(codes.float().mean().item() - 7.5) < 0.1
    scales = weights["layers.0.attention.w_qkv.scales"].float()
    assert torch.allclose(scales, torch.full_like(scales, script.INT4_SCALE), rtol=1e-3)
    assert torch.allclose(weights["layers.0.attention.w_qkv.zeros"].float(), -8 * scales)
    tok = workspace.load_tokenizer()
    assert tok.decode([5, 6]) == "t5 t6" and tok.eos_token_id == 2 and len(tok) == tiny["vocab_size"]


def test_tiny_run_writes_exact_token_counts(script, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    script.main(
        [
            "--tiny",
            "--num-prompts",
            "6",
            "--concurrency",
            "3",
            "--input-len",
            "10",
            "--output-len",
            "4",
            "--batch-sizes",
            "1,2",
            "--iters",
            "2",
            "--warmup",
            "0",
        ]
    )
    report = json.loads((tmp_path / "out" / "engine.json").read_text())
    assert report["shape"] == "tiny" and [r["weights"] for r in report["results"]] == ["fp16", "int4"]
    for result in report["results"]:
        throughput = result["throughput"]
        assert throughput["requests"] == 6 and throughput["max_in_flight"] == 3
        assert throughput["output_tokens"] == 6 * 4 == throughput["engine"]["generated_tokens"]
        assert throughput["input_tokens"] == 6 * 10
        assert [(b["batch_size"], b["output_tokens"]) for b in result["latency"]["batches"]] == [(1, 8), (2, 16)]
    out = capsys.readouterr().out.splitlines()
    # the tables come last: latency rows (2 weights x 2 batches) under their header, throughput rows above
    # CPU: no decode graphs, so every run is labelled eager
    assert [line.split()[:3] for line in out[-4:]] == [
        ["fp16", "eager", "1"], ["fp16", "eager", "2"], ["int4", "eager", "1"], ["int4", "eager", "2"]
    ]
    assert out[-5].startswith("weights") and [line.split()[0] for line in out[-8:-6]] == ["fp16", "int4"]
