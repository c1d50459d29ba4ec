"""Where deploy reads source tensors from: detect the model format, then read HF-named tensors one at a time.

HF directories are read lazily (safetensors mmap, or `torch.load(mmap=True)` for .bin shards) so a large model never
sits in memory whole; GGUF files are dequantized by transformers into a model whose state dict is read instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lmd.errors import LmdError
from lmd.model_source import ModelSource

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FORMATS = ("hf", "awq", "gptq", "compressed-tensors", "gguf")
# --model-format gptq also takes compressed-tensors pack-quantized int4 (llm-compressor's GPTQ output)
ACCEPTS = {"gptq": ("gptq", "compressed-tensors")}
QUANT_METHODS = {None: "hf", "awq": "awq", "gptq": "gptq", "compressed-tensors": "compressed-tensors"}


def quant_config(config: PretrainedConfig, model_dir: str | None = None) -> dict:
    """config.json's quantization_config, else an AutoGPTQ quantize_config.json beside it (older GPTQ repos)."""
    raw = getattr(config, "quantization_config", None)
    if raw is None and model_dir is not None and (Path(model_dir) / "quantize_config.json").is_file():
        path = Path(model_dir) / "quantize_config.json"
        try:
            return {"quant_method": "gptq", **json.loads(path.read_text())}
        except (OSError, ValueError) as exc:
            raise LmdError(f"{path}: not valid JSON ({_first_line(exc)}); fix or remove it") from None
    if raw is None:
        return {}
    return dict(raw if isinstance(raw, dict) else raw.to_dict())


def detect_format(source: ModelSource, config: PretrainedConfig, requested: str | None) -> str:
    """The format the files are in; a --model-format that disagrees with the files is an error, never a guess."""
    if source.is_gguf:
        found = "gguf"
    else:
        local = source.name_or_dir if Path(source.name_or_dir).is_dir() else None
        method = quant_config(config, local).get("quant_method")
        if method not in QUANT_METHODS:
            raise LmdError(f"{source.display_name}/config.json: quant_method={method} is not supported; deploy an "
                           "unquantized HF model, an AWQ, GPTQ or compressed-tensors checkpoint, or a .gguf file")
        found = QUANT_METHODS[method]
    if requested is None:
        return found
    if requested not in FORMATS:
        raise LmdError(f"--model-format {requested} is unknown; use one of {', '.join(FORMATS)}")
    if found not in ACCEPTS.get(requested, (requested,)):
        why = {"gguf": "it is a .gguf file", "hf": "it is an unquantized HF model"}.get(
            found, f"its config.json has quantization_config.quant_method={found}")
        raise LmdError(f"--model-format {requested} does not match {source.display_name}: {why}; "
                       f"use --model-format {found} or leave the flag out")
    return found


def check_awq_config(config: PretrainedConfig, group_size: int | None, where: str) -> int:
    """The checkpoint's group size; a --group-size that differs is an error (None: take the checkpoint's)."""
    qc = quant_config(config)
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    version = str(qc.get("version", "gemm")).lower()
    zero_point = bool(qc.get("zero_point", True))
    if bits != 4 or version != "gemm" or not zero_point:
        raise LmdError(f"{where}/config.json: AWQ bits={bits} version={version} zero_point={zero_point}; "
                       "only 4-bit asymmetric 'gemm' checkpoints (lmd awq, AutoAWQ gemm) are supported")
    ckpt_group = int(qc.get("group_size", qc.get("q_group_size", -1)))
    if ckpt_group not in (32, 64, 128):
        raise LmdError(f"{where}/config.json: quantization_config.group_size={ckpt_group}; "
                       "the engine supports 32, 64 and 128")
    if group_size is not None and ckpt_group != group_size:
        raise LmdError(f"--group-size {group_size} does not match {where}/config.json quantization_config.group_size="
                       f"{ckpt_group}; pass --group-size {ckpt_group} or leave the flag out")
    return ckpt_group


class TensorReader:
    """HF-named tensors of one checkpoint; `get` checks presence and shape and names the file on error."""

    def __init__(self, where: str) -> None:
        self.where = where

    def names(self) -> set[str]:
        raise NotImplementedError

    def _read(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        return name in self.names()

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if not self.has(name):
            raise LmdError(f"{self.where}: tensor {name} is missing; the checkpoint is incomplete or not a "
                           "supported architecture (re-save or re-download it)")
        tensor = self._read(name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise LmdError(f"{self.where}: tensor {name} has shape {list(tensor.shape)} but config.json implies "
                           f"{list(shape)}; the weights do not match the config")
        return tensor


class SafetensorsReader(TensorReader):
    def __init__(self, files: list[Path], where: str) -> None:
        from safetensors import safe_open

        super().__init__(where)
        self._handles = {}
        self._file_of: dict[str, Path] = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
                keys = list(handle.keys())
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for corrupt files
                raise LmdError(f"{path}: not a readable safetensors file ({_first_line(exc)}); "
                               "re-download or re-save the model") from None
            self._handles[path] = handle
            for key in keys:
                self._file_of[key] = path

    def names(self) -> set[str]:
        return set(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def _read(self, name: str) -> torch.Tensor:
        path = self._file_of[name]
        try:
            return self._handles[path].get_tensor(name)
        except Exception as exc:  # noqa: BLE001
            raise LmdError(f"{path}: cannot read tensor {name} ({_first_line(exc)}); "
                           "the file is corrupt, re-download or re-save the model") from None


class StateDictReader(TensorReader):
    def __init__(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        super().__init__(where)
        self._tensors = tensors

    def names(self) -> set[str]:
        return set(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def _read(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def open_hf_dir(model_dir: str) -> TensorReader:
    """The shards named by model.safetensors.index.json (Mistral repos also hold a differently named
    consolidated.safetensors), else every *.safetensors file, else pytorch_model*.bin shards."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise LmdError(f"{index}: not a valid safetensors index ({_first_line(exc)}); re-download it") from None
        missing = [name for name in shards if not (root / name).is_file()]
        if missing:
            raise LmdError(f"{root}: shard {missing[0]} named by {index.name} is missing; re-download the model")
        return SafetensorsReader([root / name for name in shards], str(root))
    files = sorted(root.glob("*.safetensors"))
    if files:
        return SafetensorsReader(files, str(root))
    bins = sorted(root.glob("pytorch_model*.bin"))
    if not bins:
        raise LmdError(f"{root} has no *.safetensors or pytorch_model*.bin weights; give a complete HF model directory")
    tensors: dict[str, torch.Tensor] = {}
    for path in bins:
        try:
            tensors.update(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
        except Exception as exc:  # noqa: BLE001
            raise LmdError(f"{path}: cannot read PyTorch weights ({_first_line(exc)}); re-download the model") from None
    return StateDictReader(tensors, str(root))


def open_gguf(source: ModelSource) -> TensorReader:
    """transformers dequantizes GGUF fastest into float32; the converter casts each tensor to the target dtype."""
    from lmd.model_source import load_causal_lm

    model = load_causal_lm(source, dtype="float32")
    return StateDictReader(dict(model.state_dict()), source.display_name)


def hub_model_dir(source: ModelSource) -> str:
    """A local directory for the source: HF dirs as they are; hub ids only when already in the local HF cache."""
    if Path(source.name_or_dir).is_dir():
        return source.name_or_dir
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(source.name_or_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - hub errors vary by version
        raise LmdError(f"{source.name_or_dir} is not a local directory and not in the HF cache ({_first_line(exc)}); "
                       "download it first or give a local path") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
