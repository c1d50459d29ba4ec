"""W8A8 checkpoint writer: every decoder linear to 8-bit per-channel weights, saved as a compressed-tensors HF
directory (vLLM / llm-compressor's W8A8 layout, what `lmd deploy` reads back as weight_type int8 | fp8).

    <linear>.weight        int8 or float8_e4m3fn [N, K]
    <linear>.weight_scale  fp32 [N, 1]              W ≈ weight · weight_scale
    config.json quantization_config: quant_method compressed-tensors, format int-quantized | float-quantized,
    weights 8-bit symmetric per channel, input_activations 8-bit symmetric dynamic per token; lm_head ignored,
    and so is every linear of `ignore` (mixed precision), stored as a plain `weight` in the float dtype.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lmd.arch import ArchSpec
from lmd.errors import LmdError
from lmd.turbomind.kernels.w8a8_reference import quantize_weight_per_channel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

QDTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def resolve_ignore(names: tuple[str, ...], arch: ArchSpec, num_layers: int) -> list[str]:
    """`--ignore` names -> full module names, in layer order. A name is a linear of the architecture (`down_proj` or
    `mlp.down_proj`: every layer) or one layer's module (`model.layers.3.mlp.down_proj`). Linears the engine fuses
    (q/k/v, gate/up) must be ignored together, as they share one kernel."""
    picked: set[tuple[int, str]] = set()
    for name in names:
        linear = next((lin for lin in arch.linears if name in (lin, lin.rsplit(".", 1)[-1])), None)
        if linear is not None:
            picked.update((i, linear) for i in range(num_layers))
            continue
        layer, _, rest = name.removeprefix(f"{arch.layers}.").partition(".")
        if not (name.startswith(f"{arch.layers}.") and layer.isdigit() and int(layer) < num_layers
                and rest in arch.linears):
            leaves = ", ".join(lin.rsplit(".", 1)[-1] for lin in arch.linears)
            raise LmdError(f"--ignore {name}: not a decoder linear of this model; give one of {leaves} (every "
                           f"layer) or {arch.layers}.N.{arch.down} with N < {num_layers}")
        picked.add((int(layer), rest))
    for fused in ((arch.q, arch.k, arch.v), (arch.gate, arch.up)):
        for i in range(num_layers):
            inside = [lin for lin in fused if (i, lin) in picked]
            if inside and len(inside) < len(fused):
                raise LmdError(f"--ignore: {arch.layers}.{i}.{inside[0]} is fused with "
                               f"{', '.join(f for f in fused if f not in inside)} in the engine; ignore them together")
    return [f"{arch.layers}.{i}.{lin}" for i in range(num_layers) for lin in arch.linears if (i, lin) in picked]


def quantization_config(scheme: str, ignore: Sequence[str] = ()) -> dict:
    kind = "int" if scheme == "int8" else "float"
    args = {"num_bits": 8, "type": kind, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": f"{kind}-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {**args, "strategy": "channel", "dynamic": False},
                                          "input_activations": {**args, "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head", *ignore]}


def quantized_state_dict(model: PreTrainedModel, arch: ArchSpec, scheme: str, dtype: torch.dtype,
                         ignore: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """The model's tensors with every decoder linear not in `ignore` as weight + weight_scale; the rest cast to
    `dtype`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if model.config.tie_word_embeddings and name == f"{arch.lm_head}.weight":
            continue
        if leaf == "weight" and module.startswith(f"{arch.layers}.") and module.split(".", 3)[-1] in arch.linears \
                and module not in ignore:
            q, scale = quantize_weight_per_channel(tensor, QDTYPES[scheme])
            out[name], out[f"{module}.weight_scale"] = q.contiguous(), scale[:, None].contiguous()
        else:
            out[name] = tensor.detach().to(dtype).contiguous()
    return out


def write_checkpoint(dst: Path, model: PreTrainedModel, tokenizer, arch: ArchSpec, scheme: str,
                     dtype: torch.dtype, provenance: dict, ignore: Sequence[str] = ()) -> int:
    """config.json, generation_config.json, tokenizer, model.safetensors, smooth_quant.json into dst; bytes written."""
    from safetensors.torch import save_file

    state = quantized_state_dict(model, arch, scheme, dtype, ignore)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(scheme, ignore)
    for key in ("dtype", "torch_dtype"):  # transformers 5 writes dtype, 4 torch_dtype; both read either
        if key in config:
            config[key] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(dst))
    tokenizer.save_pretrained(str(dst))
    (dst / "smooth_quant.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
