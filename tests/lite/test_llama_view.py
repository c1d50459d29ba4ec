"""Phi-3 (fused qkv_proj / gate_up_proj) through lmd.lite as its Llama view: the same logits over the same tensors
(longrope on both sides of its pretraining length too), partial rotary refused in one line, and `lmd awq` -> deploy
-> the engine end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lmd.errors import LmdError
from lmd.lite.llama_view import as_llama, llama_config
from tests.conftest import build_tiny_model

# Phi-3.5's long-context RoPE at a tiny scale (head_dim 32: 16 factors each), pretrained to 64 positions
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 16 for i in range(16)],
            "long_factor": [4.0 + i / 4 for i in range(16)], "original_max_position_embeddings": 64}


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize(("tied", "longrope", "length"), [(False, False, 19), (True, False, 19), (False, True, 40),
                                                         (False, True, 100)])
def test_the_view_computes_the_same_logits_over_the_same_tensors(tmp_path, tied, longrope, length):
    rope = {"max_position_embeddings": 512, "original_max_position_embeddings": 64, "rope_parameters": LONGROPE}
    phi3 = _load(build_tiny_model(tmp_path / "phi3", "phi3", tie_word_embeddings=tied, **(rope if longrope else {})))
    ids = torch.randint(0, 49152, (2, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = phi3(ids).logits
    fused = phi3.model.layers[1].self_attn.qkv_proj.weight
    llama = as_llama(phi3)
    assert type(llama).__name__ == "LlamaForCausalLM" and llama.config.model_type == "llama"
    attn = llama.model.layers[1].self_attn
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()  # rows of the fused tensor, not a copy
    assert torch.equal(attn.v_proj.weight, fused[-attn.v_proj.weight.shape[0]:])
    assert (llama.lm_head.weight.data_ptr() == llama.model.embed_tokens.weight.data_ptr()) == tied
    if longrope:  # the same long-context RoPE, pretrained to 64 positions, on both
        assert llama.model.rotary_emb.attention_scaling == phi3.model.rotary_emb.attention_scaling > 1.1
    with torch.no_grad():
        assert torch.equal(llama(ids).logits, expected)


def test_models_with_separate_linears_pass_through(tiny_llama):
    model = _load(tiny_llama)
    assert as_llama(model) is model


def test_partial_rotary_is_refused_in_one_line():
    from transformers import AutoConfig

    config = AutoConfig.for_model("phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, vocab_size=49152, rope_parameters={
                                      "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    with pytest.raises(LmdError, match="partial_rotary_factor=0.5: lmd awq, calibrate and smooth-quant run it as"):
        llama_config(config)


def test_lmd_awq_on_phi3_deploys_and_the_engine_matches_the_dequantized_model(tmp_path):
    """The CLI quantizes the Llama view (an AutoAWQ Llama checkpoint); deploy at tp 2; the engine's logits against
    that checkpoint dequantized in transformers."""
    from lmd.deploy.converter import deploy
    from lmd.lite.awq_export import load_awq_as_float
    from lmd.turbomind.forward_batch import ForwardBatch
    from lmd.turbomind.model_runner import ModelRunner
    from lmd.turbomind.workspace import open_workspace

    src = build_tiny_model(tmp_path / "phi3", "phi3")
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "awq"
    run = subprocess.run([sys.executable, "-m", "lmd", "awq", str(src), "--work-dir", str(out), "--w-group-size", "32",
                          "--method", "awq", "--calib-dataset", str(calib), "--calib-samples", "2", "--calib-seqlen",
                          "32", "--no-eval"], capture_output=True, text=True, env=os.environ)
    assert run.returncode == 0, run.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    ws = deploy("base", str(out), str(tmp_path / "ws"), group_size=32, tp=2, progress=False)
    runner = ModelRunner(open_workspace(ws, dtype="fp32", cache_block_seq_len=4, cache_max_entry_count=32))
    prompt = torch.randint(0, 49152, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    batch = ForwardBatch.build([(prompt, 0, list(range(6)))], 4, list(range(len(prompt))), runner.device)
    got = runner.model.forward(batch, runner.cache)
    with torch.no_grad():
        expected = load_awq_as_float(out)(torch.tensor([prompt])).logits[0]
    # the engine keeps each group's zero point as an fp16 offset (-zero * scale): weights differ by an fp16 rounding
    assert (got - expected).abs().max() / (expected.amax(-1) - expected.amin(-1)).max() < 3e-3
