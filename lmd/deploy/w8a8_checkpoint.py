"""W8A8 compressed-tensors checkpoints (`lmd smooth-quant` output, llm-compressor W8A8 / FP8-dynamic): the scheme
from quantization_config, and one linear's tensors.

    weight        int8 or float8_e4m3fn [N, K]   symmetric per output channel
    weight_scale  [N, 1] (or [N])                W = weight * weight_scale
    activations   dynamic, per token, symmetric, same 8-bit type (quantized by the engine at run time)

A linear in quantization_config's `ignore` list (mixed precision: `lmd smooth-quant --ignore`, llm-compressor's
ignore) is stored as a plain 16-bit `weight` without weight_scale and served as a float linear. Linears the engine
fuses (q/k/v, gate/up) share one input and one kernel, so they must be all quantized or all ignored (vLLM refuses
the mix too).
"""

from __future__ import annotations

import torch

from lmd.arch import ARCHITECTURES
from lmd.deploy.int4_schemes import compressed_tensors_group
from lmd.deploy.linears import FloatLinear, W8A8Linear
from lmd.deploy.source_weights import TensorReader
from lmd.errors import LmdError

W8A8_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")
WEIGHT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def w8a8_weight_type(qc: dict, where: str) -> str | None:
    """int8 or fp8 for a W8A8 dynamic-per-token checkpoint; None for any other compressed-tensors scheme."""
    fmt, weights, activations = compressed_tensors_group(qc, where)
    if fmt not in W8A8_FORMATS:
        return None
    kind = weights.get("type", "int")
    if int(weights.get("num_bits", 0)) != 8 or kind not in ("int", "float") or weights.get("strategy") != "channel" \
            or not weights.get("symmetric", True):
        raise LmdError(f"{where}: compressed-tensors {fmt} weights {weights}; lmd serves 8-bit symmetric "
                       "per-channel weights (int or float)")
    act = dict(activations or {})
    if int(act.get("num_bits", 0)) != 8 or act.get("type", "int") != kind or act.get("strategy") != "token" \
            or not act.get("dynamic", False):
        raise LmdError(f"{where}: compressed-tensors input_activations {activations or None}; lmd serves W8A8 "
                       f"with dynamic per-token {kind} activations (re-quantize with `lmd smooth-quant`)")
    return "int8" if kind == "int" else "fp8"


def read_w8a8_linear(reader: TensorReader, module: str, n: int, k: int,
                     weight_type: str) -> W8A8Linear | FloatLinear:
    weight = reader.get(f"{module}.weight", (n, k))
    _check_fused_alike(reader, module)
    if weight.is_floating_point() and weight.itemsize >= 2 and not reader.has(f"{module}.weight_scale"):
        return FloatLinear(weight)
    if weight.dtype != WEIGHT_DTYPES[weight_type]:
        raise LmdError(f"{reader.where}: {module}.weight is {weight.dtype}, but quantization_config says "
                       f"{weight_type}; the checkpoint is inconsistent, re-export it")
    scale = reader.get(f"{module}.weight_scale")
    if scale.numel() != n:
        raise LmdError(f"{reader.where}: {module}.weight_scale has shape {list(scale.shape)}; expected [{n}, 1]")
    return W8A8Linear(weight, scale.reshape(n).float())


def _fused_siblings(module: str) -> list[str]:
    """The linears the engine fuses with `module` (q/k/v, gate/up), by the architecture registry's names."""
    for spec in ARCHITECTURES.values():
        for group in ((spec.q, spec.k, spec.v), (spec.gate, spec.up)):
            for name in group:
                if module.endswith("." + name):
                    prefix = module.removesuffix(name)
                    return [prefix + other for other in group if other != name]
    return []


def _check_fused_alike(reader: TensorReader, module: str) -> None:
    quantized = reader.has(f"{module}.weight_scale")
    mixed = [s for s in _fused_siblings(module) if reader.has(f"{s}.weight_scale") != quantized]
    if mixed:
        raise LmdError(f"{reader.where}: {module} is {'quantized' if quantized else 'ignored (16-bit)'} but "
                       f"{', '.join(mixed)}, fused with it, is not; quantize or ignore the fused linears together")
