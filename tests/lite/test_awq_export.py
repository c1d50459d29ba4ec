"""The AutoAWQ gemm directory: layout, config, and reading it back gives the fake-quantized model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lmd.lite.awq import AwqConfig, quantize_model
from lmd.lite.awq_export import WEIGHTS_FILE, dequantize_gemm, load_awq_as_float, write_awq_model
from tests.conftest import build_tiny_model, smollm2_tokenizer


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


EXTENSIONS = {"asym_clip": True, "refine_scale": True, "gptq": True, "quantized_inputs": True}


@pytest.mark.parametrize(
    "model_type,tied,search,extra",
    [("llama", False, True, {}), ("qwen2", True, False, {}), ("llama", False, True, EXTENSIONS)],
)
def test_gemm_directory_reads_back_as_the_fake_quantized_model(tmp_path, model_type, tied, search, extra):
    model = _load(build_tiny_model(tmp_path / "src", model_type, tie_word_embeddings=tied))
    ids = torch.randint(0, 49152, (4, 32), generator=torch.Generator().manual_seed(0))
    quantized = quantize_model(
        model, ids, AwqConfig(group_size=32, batch_size=2, search_tokens=64, search_scale=search, clip=search, **extra)
    )
    out = tmp_path / "awq"
    out.mkdir()
    write_awq_model(model, quantized, smollm2_tokenizer(), out, 32, {"method": "awq"})

    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
    }
    tensors = load_file(str(out / WEIGHTS_FILE))
    name = "model.layers.0.self_attn.q_proj"
    assert f"{name}.weight" not in tensors
    assert tensors[f"{name}.qweight"].dtype == torch.int32 and tensors[f"{name}.qweight"].shape == (128, 16)
    assert tensors[f"{name}.qzeros"].shape == (4, 16) and tensors[f"{name}.scales"].dtype == torch.float16
    assert (f"{name}.bias" in tensors) == (model_type == "qwen2")
    assert ("lm_head.weight" in tensors) == (not tied)
    assert tensors["model.norm.weight"].dtype == torch.float16
    for key, q in quantized.items():
        got = dequantize_gemm(tensors[f"{key}.qweight"], tensors[f"{key}.qzeros"], tensors[f"{key}.scales"])
        assert torch.equal(got, q.dequantize())

    reloaded = load_awq_as_float(out)
    for key, param in model.state_dict().items():
        expected = param if key.removesuffix(".weight") in quantized else param.half().float()
        assert torch.equal(reloaded.state_dict()[key], expected), key
    if smollm2_tokenizer() is not None:
        assert (out / "tokenizer.json").is_file() and "im_start" in (out / "chat_template.jinja").read_text()


def test_qwen3_awq_deploys_and_the_engine_matches_its_fake_quantized_model(tmp_path):
    """Qwen3 end to end: AWQ (search and clip see the per-head q/k norms through the attention they run), the AutoAWQ
    directory, deploy at tp 2, and the engine's logits against the dequantized model in transformers."""
    from lmd.deploy.converter import deploy
    from lmd.turbomind.forward_batch import ForwardBatch
    from lmd.turbomind.model_runner import ModelRunner
    from lmd.turbomind.workspace import open_workspace

    model = _load(build_tiny_model(tmp_path / "src", "qwen3", head_dim=32))
    ids = torch.randint(0, 49152, (4, 32), generator=torch.Generator().manual_seed(0))
    quantized = quantize_model(model, ids, AwqConfig(group_size=32, batch_size=2, search_tokens=64))
    out = tmp_path / "awq"
    out.mkdir()
    write_awq_model(model, quantized, smollm2_tokenizer(), out, 32, {"method": "awq"})
    ws = deploy("base", str(out), str(tmp_path / "ws"), group_size=32, tp=2, progress=False)
    runner = ModelRunner(open_workspace(ws, dtype="fp32", cache_block_seq_len=4, cache_max_entry_count=32))
    prompt = ids[0, :20].tolist()
    batch = ForwardBatch.build([(prompt, 0, list(range(5)))], 4, list(range(len(prompt))), runner.device)
    got = runner.model.forward(batch, runner.cache)
    with torch.no_grad():
        expected = load_awq_as_float(out)(torch.tensor([prompt])).logits[0]
    # the engine keeps each group's zero point as an fp16 offset (-zero * scale): weights differ by an fp16 rounding
    assert (got - expected).abs().max() / (expected.amax(-1) - expected.amin(-1)).max() < 3e-3
