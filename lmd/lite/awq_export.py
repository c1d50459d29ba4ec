"""Write (and read back) a quantized model as an HF directory in AutoAWQ's "gemm" format.

Per quantized linear `<name>` (W [out, in], group size g), instead of `<name>.weight`:

    <name>.qweight  int32 [in, out / 8]      codes, 8 output channels per int32, nibble order [0, 2, 4, 6, 1, 3, 5, 7]
    <name>.qzeros   int32 [in / g, out / 8]  integer zero points 0..15, packed the same way
    <name>.scales   fp16  [in / g, out]
    <name>.bias     fp16  [out]              when the linear has one

    W.T[k, n] = (code[k, n] - zero[k // g, n]) * scale[k // g, n]

Every other tensor (embeddings, norms with the folded AWQ scales, lm_head unless tied) is stored in fp16.
config.json carries quantization_config = {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": true,
"version": "gemm"}, which is what AutoAWQ, vLLM and transformers' AWQ loader read.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lmd.arch import get_arch
from lmd.lite.quantizer import QuantizedWeight
from lmd.turbomind.kernels.w4a16_layout import pack_awq_int32, unpack_awq_int32

WEIGHTS_FILE = "model.safetensors"


def quantization_config(group_size: int) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}


def gemm_tensors(q: QuantizedWeight) -> dict[str, torch.Tensor]:
    return {"qweight": pack_awq_int32(q.codes.t().contiguous()),
            "qzeros": pack_awq_int32(q.zeros.t().contiguous()),
            "scales": q.scales.t().contiguous().to(torch.float16)}


def dequantize_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """AutoAWQ gemm tensors -> the dense float32 weight W [out, in] (the reader's view, for tests and tools)."""
    codes = unpack_awq_int32(qweight).to(torch.float32)  # [in, out]
    group = codes.shape[0] // scales.shape[0]
    zeros = unpack_awq_int32(qzeros).to(torch.float32).repeat_interleave(group, dim=0)
    s = scales.to(torch.float32).repeat_interleave(group, dim=0)
    return ((codes - zeros) * s).t().contiguous()


def awq_state_dict(model: nn.Module, quantized: dict[str, QuantizedWeight]) -> dict[str, torch.Tensor]:
    skip = {f"{name}.weight" for name in quantized}
    if getattr(model.config, "tie_word_embeddings", False):
        skip.add(f"{get_arch(model.config).lm_head}.weight")  # the loader re-ties it to the embeddings
    tensors = {name: _fp16(tensor) for name, tensor in model.state_dict().items() if name not in skip}
    for name, q in quantized.items():
        for suffix, tensor in gemm_tensors(q).items():
            tensors[f"{name}.{suffix}"] = tensor
    return tensors


def write_awq_model(model: nn.Module, quantized: dict[str, QuantizedWeight], tokenizer: Any, out_dir: Path,
                    group_size: int, provenance: dict[str, Any]) -> None:
    """Fill `out_dir` (an empty temporary directory; the caller renames it into place)."""
    from safetensors.torch import save_file

    weights = out_dir / WEIGHTS_FILE
    save_file(awq_state_dict(model, quantized), str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)
    config = copy.deepcopy(model.config)
    config.quantization_config = quantization_config(group_size)
    config.dtype = torch.float16
    config.save_pretrained(out_dir)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    (out_dir / "lmd_awq.json").write_text(json.dumps(provenance, indent=2) + "\n")


def _fp16(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point():
        tensor = tensor.to(torch.float16)
    return tensor.detach().cpu().contiguous().clone()


def dequantized_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Read an AutoAWQ gemm directory back as a float32 state dict (`<name>.weight` for every quantized linear)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(model_dir) / WEIGHTS_FILE))
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(".qweight"):
            prefix = name.removesuffix(".qweight")
            state[f"{prefix}.weight"] = dequantize_gemm(tensor, tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"])
        elif not name.endswith((".qzeros", ".scales")):
            state[name] = tensor.to(torch.float32) if tensor.is_floating_point() else tensor
    return state


def load_awq_as_float(model_dir: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An AutoAWQ gemm directory as a plain float causal LM with the dequantized weights (evaluation, tests)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.quantization_config = None
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in dequantized_state_dict(model_dir).items()}
    missing = set(model.load_state_dict(state, strict=False).missing_keys)
    tied = {f"{get_arch(config).lm_head}.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if missing - tied:
        raise ValueError(f"{model_dir}: tensors missing from {WEIGHTS_FILE}: {sorted(missing - tied)[:4]}")
    model.tie_weights()
    return model.eval()
