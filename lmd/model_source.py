"""Where a model comes from: a Hugging Face directory, a `.gguf` file, or a hub name.

Every command that takes MODEL goes through `resolve_model` + `load_causal_lm` / `load_tokenizer`, so GGUF files work
anywhere an HF directory does (transformers dequantizes GGUF weights to float on load).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmd.errors import LmdError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelSource:
    """`name_or_dir` is what transformers' from_pretrained takes; `gguf_file` is set for GGUF models."""

    name_or_dir: str
    gguf_file: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def display_name(self) -> str:
        if self.gguf_file:
            return str(Path(self.name_or_dir) / self.gguf_file)
        return self.name_or_dir

    def hf_kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model(model: str | os.PathLike[str]) -> ModelSource:
    """Accept an HF model directory, a `.gguf` file, or a hub id (`org/name`); anything else is a one-line error."""
    text = str(model)
    path = Path(text).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise LmdError(f"model file {path} does not exist; give an existing .gguf file or an HF model directory")
        return ModelSource(str(path.resolve().parent), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource(str(path.resolve()), ggufs[0].name)
            raise LmdError(f"{path} has no config.json; give an HF model directory (config.json + weights) "
                           "or a .gguf file")
        return ModelSource(str(path.resolve()))
    if path.exists():
        raise LmdError(f"{path} is neither an HF model directory nor a .gguf file")
    looks_like_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise LmdError(f"model path {text} does not exist; give an HF model directory, a .gguf file "
                       "or a hub id org/name")
    return ModelSource(text)


def torch_dtype(name: str) -> torch.dtype:
    import torch

    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise LmdError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return table[name]


def load_config(source: ModelSource) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.name_or_dir, **source.hf_kwargs())
    except (OSError, ValueError, KeyError) as exc:
        raise LmdError(f"cannot read the config of {source.display_name}: {_first_line(exc)}") from exc


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.name_or_dir, **source.hf_kwargs())
    except (OSError, ValueError, KeyError) as exc:
        raise LmdError(f"cannot load the tokenizer of {source.display_name}: {_first_line(exc)}") from exc


@contextlib.contextmanager
def _quiet_gguf_progress() -> Iterator[None]:
    """transformers' GGUF dequantization opens its own tqdm bar (stderr must stay clean for --json). tqdm reads
    TQDM_DISABLE only when it is imported, so the module's `tqdm` is swapped for a disabled one while loading."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def load_causal_lm(source: ModelSource, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    """Load for inference (eval mode, no grad needed). GGUF weights arrive dequantized in `dtype`."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if is_awq_checkpoint(source):
        # transformers needs autoawq for these; lmd reads its own AutoAWQ-format output as dequantized float weights
        from lmd.lite.awq_export import load_awq_as_float

        return load_awq_as_float(Path(source.name_or_dir), torch_dtype(dtype)).to(device).eval()
    try:
        with _quiet_gguf_progress():
            model = AutoModelForCausalLM.from_pretrained(
                source.name_or_dir, dtype=torch_dtype(dtype), low_cpu_mem_usage=True, **source.hf_kwargs()
            )
    except (OSError, ValueError, KeyError) as exc:
        raise LmdError(f"cannot load model {source.display_name}: {_first_line(exc)}") from exc
    if source.is_gguf:
        make_serializable(model)
    return model.to(device).eval()


def is_awq_checkpoint(source: ModelSource) -> bool:
    """An AutoAWQ "gemm" directory (lmd awq output or AutoAWQ's): quantization_config.quant_method == "awq"."""
    import json

    config_path = Path(source.name_or_dir) / "config.json"
    if source.is_gguf or not config_path.is_file():
        return False
    try:
        quant = json.loads(config_path.read_text()).get("quantization_config") or {}
    except (OSError, ValueError) as exc:
        raise LmdError(f"{config_path} is not valid JSON: {_first_line(exc)}") from exc
    return quant.get("quant_method") == "awq"


def make_serializable(model: PreTrainedModel) -> None:
    """A GGUF-loaded model holds dequantized float weights but refuses save_pretrained until the marker is gone."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def check_device(device: str) -> str:
    import torch

    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise LmdError(f"unknown device {device!r}; use cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LmdError("--device cuda was given but no CUDA device is available; use --device cpu")
    return device


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
