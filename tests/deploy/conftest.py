"""AutoAWQ "gemm" checkpoints built from tiny random models with RTN codes (the real `lmd awq` is tested elsewhere)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lmd.arch import ARCHITECTURES
from lmd.turbomind.kernels.w4a16_layout import pack_awq_int32
from tests.conftest import build_tiny_model


def rtn_awq_tensors(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """W [N, K] -> AutoAWQ gemm qweight int32 [K, N/8], qzeros int32 [K/g, N/8], scales fp16 [K/g, N]."""
    n, k = weight.shape
    w = weight.float().t().reshape(k // group_size, group_size, n)
    wmax, wmin = w.amax(dim=1), w.amin(dim=1)
    scales = ((wmax - wmin).clamp(min=1e-5) / 15).half()
    s = scales.float()
    zeros = torch.round(-wmin / s).clamp(0, 15)
    codes = torch.clamp(torch.round(w / s.unsqueeze(1)) + zeros.unsqueeze(1), 0, 15).reshape(k, n)
    return {"qweight": pack_awq_int32(codes.int()), "qzeros": pack_awq_int32(zeros.int()), "scales": scales}


def build_awq_checkpoint(src: Path, dst: Path, group_size: int) -> Path:
    """Quantize every decoder linear of the HF model at `src` into an AutoAWQ gemm checkpoint at `dst`."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    arch = ARCHITECTURES[config["model_type"]]
    state = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.split(".", 3)[-1] in arch.linears:
            for key, value in rtn_awq_tensors(tensor, group_size).items():
                out[f"{module}.{key}"] = value
        else:
            out[name] = tensor.half()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                     "version": "gemm"}
    config["dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(config))
    for path in src.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens", "generation_config")):
            shutil.copy(path, dst / path.name)
    return dst


def _randomize_biases(model_dir: Path) -> Path:
    """HF initialises biases to zero, which would let a dropped or misplaced QKV bias pass a round trip."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    biases = [name for name in state if name.endswith(".bias")]
    if biases:
        generator = torch.Generator().manual_seed(1)
        for name in biases:
            state[name] = torch.randn(state[name].shape, generator=generator).to(state[name].dtype)
        save_file(state, str(path), metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """model_type -> tiny fp32 HF dir, built once per session."""
    cache: dict[tuple, Path] = {}

    def get(model_type: str = "llama", dtype: str = "float32", **overrides) -> Path:
        key = (model_type, dtype, tuple(sorted(overrides.items())))
        if key not in cache:
            path = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{model_type}-{dtype}"), model_type, dtype,
                                    **overrides)
            cache[key] = _randomize_biases(path)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_awq(tiny_models, tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def get(model_type: str = "llama", group_size: int = 64) -> Path:
        key = (model_type, group_size)
        if key not in cache:
            cache[key] = build_awq_checkpoint(tiny_models(model_type), tmp_path_factory.mktemp("awq"), group_size)
        return cache[key]

    return get
