"""`lmd deploy`: convert an HF / AWQ / GPTQ / compressed-tensors / GGUF model into a TurboMind-style workspace
(docs/workspace.md).

Order of work: validate everything that can be checked from configs (template, format, tp, dtype, dst) before any
tensor is read; then stream layer by layer into per-rank safetensors inside a temporary directory next to the
destination, and rename it into place only when complete.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lmd.arch import get_arch
from lmd.chat_templates import get_chat_template
from lmd.deploy.config_from_hf import ModelDims, build_workspace_config
from lmd.deploy.int4_schemes import Int4Scheme, engine_group_size, gptq_scheme, pack_quantized_scheme
from lmd.deploy.source_weights import check_awq_config, detect_format, hub_model_dir, open_gguf, open_hf_dir, quant_config
from lmd.deploy.w8a8_checkpoint import w8a8_weight_type
from lmd.deploy.weight_writer import write_weights
from lmd.errors import LmdError
from lmd.model_source import ModelSource, load_config, resolve_model, torch_dtype
from lmd.workspace_format.config_ini import tokenizer_dir, write_workspace_config
from lmd.workspace_format.rank_layout import RankShape, check_tp

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

WEIGHT_TYPE_OF = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class DeployResult:
    path: Path
    model_name: str
    model_format: str
    weight_type: str
    group_size: int
    tp: int
    num_tensors: int
    size_bytes: int
    seconds: float


def deploy(model_name: str, model_path: str, dst_path: str = "./workspace", model_format: str | None = None,
           group_size: int | None = None, tp: int = 1, tokenizer_path: str | None = None, dtype: str | None = None,
           force: bool = False, progress: bool = True) -> Path:
    """Write the workspace and return its path (see `run_deploy` for the full result)."""
    return run_deploy(model_name, model_path, dst_path, model_format, group_size, tp, tokenizer_path, dtype, force,
                      progress).path


def run_deploy(model_name: str, model_path: str, dst_path: str = "./workspace", model_format: str | None = None,
               group_size: int | None = None, tp: int = 1, tokenizer_path: str | None = None, dtype: str | None = None,
               force: bool = False, progress: bool = True) -> DeployResult:
    start = time.perf_counter()
    template = get_chat_template(model_name)
    source = resolve_model(model_path)
    config = load_config(source)
    where = source.display_name
    fmt = detect_format(source, config, model_format)
    arch = get_arch(config)
    dims = ModelDims.from_config(config, where)
    model_dir = None if source.is_gguf else hub_model_dir(source)
    qc = quant_config(config, model_dir)
    w8a8 = w8a8_weight_type(qc, where) if fmt == "compressed-tensors" else None
    scheme = None if w8a8 else _int4_scheme(fmt, qc, where)
    group_size = 0 if scheme is None else (check_awq_config(config, group_size, where) if fmt == "awq"
                                           else engine_group_size(scheme, dims, group_size, where))
    check_tp(tp, RankShape(dims.head_num, dims.kv_head_num, dims.head_dim, dims.inter, group_size))
    if scheme is not None and scheme.act_order and tp > 1:
        raise LmdError(f"--tp {tp}: {where} is act-order (desc_act) int4, whose wo input channels are permuted "
                       "across every rank's heads; deploy and run it with --tp 1")
    compute = _compute_dtype(fmt, config, dtype)
    if (scheme is not None or w8a8) and compute == torch.float32:
        raise LmdError(f"--dtype float32 is not a compute dtype for {w8a8 or 'int4'} weights; use float16 or bfloat16")
    tokenizer = _load_tokenizer(source, tokenizer_path)
    if template.renderer is None and not getattr(tokenizer, "chat_template", None):
        raise LmdError(f"MODEL_NAME hf uses the tokenizer's chat_template, but the tokenizer of {where} has none; "
                       "pick a template name (e.g. qwen, llama3, base) or pass --tokenizer-path")
    dst = _check_dst(dst_path, force, model_dir or source.name_or_dir)
    ws_config = build_workspace_config(
        model_name=model_name, config=config, dims=dims, tokenizer=tokenizer, model_dir=model_dir, tp=tp,
        weight_type=w8a8 or ("int4" if scheme is not None else WEIGHT_TYPE_OF[compute]), group_size=group_size,
        compute_dtype=WEIGHT_TYPE_OF[compute], where=where)

    tmp = dst.parent / f".{dst.name}.lmd-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        reader = open_gguf(source) if fmt == "gguf" else open_hf_dir(model_dir)  # type: ignore[arg-type]
        num_tensors = write_weights(tmp, reader, arch, ws_config, dims, compute, progress, scheme)
        write_workspace_config(tmp, ws_config)
        tokenizer.save_pretrained(str(tokenizer_dir(tmp)))
        _swap_into_place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    return DeployResult(dst, model_name, fmt, ws_config.weight_type, group_size, tp, num_tensors, size,
                        time.perf_counter() - start)


def _int4_scheme(fmt: str, qc: dict, where: str) -> Int4Scheme | None:
    if fmt == "awq":
        return Int4Scheme("awq", int(qc.get("group_size", qc.get("q_group_size", -1))), False, False)
    if fmt == "gptq":
        return gptq_scheme(qc, where)
    if fmt == "compressed-tensors":
        return pack_quantized_scheme(qc, where)
    return None


def _compute_dtype(fmt: str, config: PretrainedConfig, requested: str | None) -> torch.dtype:
    """--dtype wins; otherwise bf16 sources stay bf16 (fp16 could overflow them) and everything else becomes fp16."""
    if requested is not None:
        return torch_dtype(requested)
    source_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if fmt == "hf" and str(source_dtype).removeprefix("torch.") == "bfloat16":
        return torch.bfloat16
    return torch.float16


def _load_tokenizer(source: ModelSource, tokenizer_path: str | None) -> PreTrainedTokenizerBase:
    from lmd.model_source import load_tokenizer

    if tokenizer_path is None:
        try:
            return load_tokenizer(source)
        except LmdError as exc:
            raise LmdError(f"{exc}; pass --tokenizer-path") from None
    if str(tokenizer_path).endswith(".gguf"):
        return load_tokenizer(resolve_model(tokenizer_path))
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError, KeyError) as exc:
        raise LmdError(f"--tokenizer-path {tokenizer_path}: cannot load a tokenizer "
                       f"({str(exc).splitlines()[0]})") from None


def _check_dst(dst_path: str, force: bool, model_location: str) -> Path:
    dst = Path(dst_path).expanduser().resolve()
    if dst.exists() and not dst.is_dir():
        raise LmdError(f"--dst-path {dst} is a file; give a directory path")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise LmdError(f"--dst-path {dst} already exists and is not empty; pass --force to replace it "
                       "or choose another --dst-path")
    model = Path(model_location).expanduser().resolve()
    if model == dst or dst in model.parents:
        raise LmdError(f"--dst-path {dst} contains the source model {model}; choose another --dst-path")
    dst.parent.mkdir(parents=True, exist_ok=True)
    return dst


def _swap_into_place(tmp: Path, dst: Path) -> None:
    """os.replace cannot overwrite a non-empty directory: move the old one aside first, delete it last."""
    if not dst.exists():
        os.replace(tmp, dst)
        return
    old = dst.parent / f".{dst.name}.lmd-old-{os.getpid()}"
    os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)
