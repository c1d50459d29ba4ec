"""The int4 scheme of a quantized checkpoint, read from its `quantization_config` (AWQ, GPTQ, compressed-tensors).

Everything deploy needs to know before reading a tensor: the packing, the checkpoint's group size, symmetric or not,
act-order, GPTQ's v1 zero-point convention; and the engine group size it deploys to.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmd.deploy.config_from_hf import ModelDims
from lmd.errors import LmdError

ENGINE_GROUPS = (128, 64, 32)
GPTQ_CHECKPOINT_FORMATS = {"gptq": True, "gptq_v2": False}  # -> qzeros stored minus one


@dataclass(frozen=True)
class Int4Scheme:
    fmt: str  # awq | gptq | compressed-tensors
    group_size: int  # the checkpoint's; -1: one group over all of K
    sym: bool
    act_order: bool
    zeros_minus_one: bool = False


def gptq_scheme(qc: dict, where: str) -> Int4Scheme:
    bits = int(qc.get("bits", 4))
    if bits != 4:
        raise LmdError(f"{where}: GPTQ bits={bits}; only 4-bit checkpoints are supported")
    checkpoint_format = str(qc.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
        raise LmdError(f"{where}: GPTQ checkpoint_format={checkpoint_format} is not supported; re-save it with "
                       "GPTQModel in format gptq or gptq_v2")
    act_order = bool(qc.get("desc_act", False)) and not bool(qc.get("static_groups", False))
    return Int4Scheme("gptq", int(qc.get("group_size", 128)), bool(qc.get("sym", True)), act_order,
                      GPTQ_CHECKPOINT_FORMATS[checkpoint_format])


def compressed_tensors_group(qc: dict, where: str) -> tuple[str, dict, dict | None]:
    """(format, weights args, input_activations args) of the checkpoint's single config group."""
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise LmdError(f"{where}: compressed-tensors config has {len(groups)} config_groups; lmd deploys "
                       "checkpoints with one scheme for every decoder linear")
    group = next(iter(groups.values()))
    return str(group.get("format") or qc.get("format")), dict(group.get("weights") or {}), group.get(
        "input_activations")


def pack_quantized_scheme(qc: dict, where: str) -> Int4Scheme:
    fmt, weights, activations = compressed_tensors_group(qc, where)
    if fmt != "pack-quantized" or activations:
        raise LmdError(f"{where}: compressed-tensors format={fmt} with input_activations={activations} is not "
                       "W4A16; lmd deploys pack-quantized int4 weight-only checkpoints")
    bits, kind, strategy = int(weights.get("num_bits", 0)), weights.get("type", "int"), weights.get("strategy")
    if bits != 4 or kind != "int" or strategy not in ("group", "channel"):
        raise LmdError(f"{where}: compressed-tensors weights num_bits={bits} type={kind} strategy={strategy}; "
                       "only 4-bit int weights with strategy group or channel are supported")
    group_size = int(weights.get("group_size") or -1) if strategy == "group" else -1
    actorder = weights.get("actorder")
    return Int4Scheme("compressed-tensors", group_size, bool(weights.get("symmetric", True)),
                      actorder in ("group", True))


def engine_group_size(scheme: Int4Scheme, dims: ModelDims, requested: int | None, where: str) -> int:
    """The checkpoint's group size, or for one group over K (per channel) the widest engine group dividing every
    linear's K; a --group-size that differs is an error."""
    widths = (dims.hidden, dims.head_num * dims.head_dim, dims.inter)
    if scheme.group_size == -1:
        fits = [g for g in ENGINE_GROUPS if all(k % g == 0 for k in widths)]
        if not fits:
            raise LmdError(f"{where}: per-channel int4 needs every linear's K ({', '.join(map(str, widths))}) to be a "
                           "multiple of 32 for the engine's groups")
        group = fits[0] if requested is None else requested
        if group not in fits:
            raise LmdError(f"--group-size {requested}: {where} is quantized per channel; use --group-size "
                           f"{' or '.join(map(str, fits))} or leave the flag out")
        return group
    if scheme.group_size not in ENGINE_GROUPS:
        raise LmdError(f"{where}/config.json: quantization group_size={scheme.group_size}; "
                       "the engine supports 32, 64, 128 and -1 (per channel)")
    if requested is not None and requested != scheme.group_size:
        raise LmdError(f"--group-size {requested} does not match {where}/config.json group_size="
                       f"{scheme.group_size}; pass --group-size {scheme.group_size} or leave the flag out")
    return scheme.group_size
