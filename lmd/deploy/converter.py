"""`lmd deploy`: convert an HF / AWQ / GGUF model into a TurboMind-style workspace (docs/workspace.md).

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

from lmd.arch import ArchSpec, get_arch
from lmd.chat.templates import get_chat_template
from lmd.deploy.config_from_hf import ModelDims, build_workspace_config
from lmd.deploy.safetensors_stream import SafetensorsStreamWriter
from lmd.deploy.source_weights import TensorReader, check_awq_config, detect_format, hub_model_dir, open_gguf, open_hf_dir
from lmd.deploy.tp_split import (
    FloatLinear,
    Int4Linear,
    Linear,
    check_tp,
    pad_vocab,
    qkv_bias_rank,
    qkv_rank,
    row_rank,
    w13_rank,
)
from lmd.deploy.workspace_config import WorkspaceConfig, rank_weights_path, tokenizer_dir, write_workspace_config
from lmd.errors import LmdError
from lmd.model_source import load_config, resolve_model, torch_dtype
from lmd.turbomind.kernels.w4a16_layout import awq_to_engine

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
           group_size: int = 128, tp: int = 1, tokenizer_path: str | None = None, dtype: str | None = None,
           force: bool = False, progress: bool = True) -> Path:
    """Write the workspace and return its path (see `run_deploy` for the full result)."""
    return run_deploy(model_name, model_path, dst_path, model_format, group_size, tp, tokenizer_path, dtype, force,
                      progress).path


def run_deploy(model_name: str, model_path: str, dst_path: str = "./workspace", model_format: str | None = None,
               group_size: int = 128, tp: int = 1, tokenizer_path: str | None = None, dtype: str | None = None,
               force: bool = False, progress: bool = True) -> DeployResult:
    start = time.perf_counter()
    template = get_chat_template(model_name)
    source = resolve_model(model_path)
    config = load_config(source)
    where = source.display_name
    fmt = detect_format(source, config, model_format)
    get_arch(config)
    dims = ModelDims.from_config(config, where)
    model_dir = None if source.is_gguf else hub_model_dir(source)
    if fmt == "awq":
        check_awq_config(config, group_size, where)
    else:
        group_size = 0
    check_tp(tp, dims, group_size)
    compute = _compute_dtype(fmt, config, dtype)
    tokenizer = _load_tokenizer(source, tokenizer_path)
    if template.renderer is None and not getattr(tokenizer, "chat_template", None):
        raise LmdError(f"MODEL_NAME hf uses the tokenizer's chat_template, but the tokenizer of {where} has none; "
                       "pick a template name (e.g. qwen, llama3, base) or pass --tokenizer-path")
    dst = _check_dst(dst_path, force, model_dir or source.name_or_dir)
    ws_config = build_workspace_config(
        model_name=model_name, config=config, dims=dims, tokenizer=tokenizer, model_dir=model_dir, tp=tp,
        weight_type="int4" if fmt == "awq" else WEIGHT_TYPE_OF[compute], group_size=group_size,
        compute_dtype=WEIGHT_TYPE_OF[compute], where=where)
    if fmt == "awq" and compute == torch.float32:
        raise LmdError("--dtype float32 is not a compute dtype for int4 weights; use float16 or bfloat16")

    tmp = dst.parent / f".{dst.name}.lmd-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        reader = open_gguf(source) if fmt == "gguf" else open_hf_dir(model_dir)  # type: ignore[arg-type]
        num_tensors = _write_weights(tmp, reader, get_arch(config), ws_config, dims, compute, progress)
        write_workspace_config(tmp, ws_config)
        tokenizer.save_pretrained(str(tokenizer_dir(tmp)))
        _swap_into_place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    return DeployResult(dst, model_name, fmt, ws_config.weight_type, group_size, tp, num_tensors, size,
                        time.perf_counter() - start)


def _compute_dtype(fmt: str, config: PretrainedConfig, requested: str | None) -> torch.dtype:
    """--dtype wins; otherwise bf16 sources stay bf16 (fp16 could overflow them) and everything else becomes fp16."""
    if requested is not None:
        return torch_dtype(requested)
    source_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if fmt == "hf" and str(source_dtype).removeprefix("torch.") == "bfloat16":
        return torch.bfloat16
    return torch.float16


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _load_tokenizer(source, tokenizer_path: str | None) -> PreTrainedTokenizerBase:
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


def _cast(tensor: torch.Tensor, dtype: torch.dtype, name: str, where: str) -> torch.Tensor:
    """Cast, refusing values that fp16 cannot hold (bf16 / fp32 sources); one min/max pass, no temporaries."""
    if dtype == torch.float16 and tensor.dtype in (torch.float32, torch.bfloat16) and tensor.numel():
        low, high = torch.aminmax(tensor)
        if max(-float(low), float(high)) > torch.finfo(torch.float16).max:
            raise LmdError(f"{where}: tensor {name} has values beyond float16's range; deploy with --dtype bfloat16")
    return tensor.to(dtype)


class _Converter:
    def __init__(self, reader: TensorReader, arch: ArchSpec, cfg: WorkspaceConfig, dims: ModelDims,
                 dtype: torch.dtype) -> None:
        self.reader, self.arch, self.cfg, self.dims, self.dtype = reader, arch, cfg, dims, dtype
        self.int4 = cfg.weight_type == "int4"

    def vector(self, name: str, size: int) -> torch.Tensor:
        return _cast(self.reader.get(name, (size,)), self.dtype, name, self.reader.where)

    def matrix(self, name: str, rows: int, cols: int) -> torch.Tensor:
        return _cast(self.reader.get(name, (rows, cols)), self.dtype, name, self.reader.where)

    def linear(self, module: str, n: int, k: int) -> Linear:
        if not self.int4:
            return FloatLinear(self.matrix(f"{module}.weight", n, k))
        g = self.cfg.group_size
        if self.reader.has(f"{module}.weight") and not self.reader.has(f"{module}.qweight"):
            raise LmdError(f"{self.reader.where}: {module} is not quantized (it has .weight, not .qweight); "
                           "lmd deploy needs every q/k/v/o/gate/up/down linear in AWQ int4")
        if n % 8 or k % g:
            raise LmdError(f"{self.reader.where}: {module} is [{n}, {k}]; AWQ needs N % 8 == 0 and K % {g} == 0")
        qweight = self.reader.get(f"{module}.qweight", (k, n // 8))
        qzeros = self.reader.get(f"{module}.qzeros", (k // g, n // 8))
        scales = self.reader.get(f"{module}.scales", (k // g, n))
        return Int4Linear(*awq_to_engine(qweight, qzeros, scales, g, self.dtype))

    def check_no_extra_bias(self, prefix: str) -> None:
        for module in (self.arch.o, self.arch.gate, self.arch.up, self.arch.down):
            if self.reader.has(f"{prefix}{module}.bias"):
                raise LmdError(f"{self.reader.where}: {prefix}{module}.bias is not supported by the workspace format "
                               "(only the fused QKV may have a bias)")


def _write_weights(tmp: Path, reader: TensorReader, arch: ArchSpec, cfg: WorkspaceConfig, dims: ModelDims,
                   dtype: torch.dtype, progress: bool) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    tp, h, d = cfg.tensor_para_size, dims.hidden, dims.head_dim
    conv = _Converter(reader, arch, cfg, dims, dtype)
    rank_tensors = [0] * tp
    writers = [SafetensorsStreamWriter(_mkparent(rank_weights_path(tmp, r)),
                                       {"format": "pt", "rank": str(r), "tensor_para_size": str(tp)}) for r in range(tp)]

    def put(rank: int, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            writers[rank].add(name, tensor)
            rank_tensors[rank] += 1

    bar = Progress(TextColumn("[bold]deploy[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True, disable=not progress)
    try:
        with bar:
            task = bar.add_task("embeddings", total=2 + 4 * dims.num_layer)
            embed = pad_vocab(conv.matrix(f"{arch.embed}.weight", dims.vocab, h), cfg.padded_vocab_size)
            norm = conv.vector(f"{arch.final_norm}.weight", h)
            output = None
            if not dims.tie_word_embeddings:
                output = pad_vocab(conv.matrix(f"{arch.lm_head}.weight", dims.vocab, h), cfg.padded_vocab_size)
            for r in range(tp):
                put(r, {"tok_embeddings.weight": embed, "norm.weight": norm})
                if output is not None:
                    put(r, {"output.weight": output})
            del embed, output
            bar.advance(task, 2)
            for i in range(dims.num_layer):
                src, dst = f"{arch.layers}.{i}.", f"layers.{i}."
                conv.check_no_extra_bias(src)
                bar.update(task, description=f"layer {i} attention")
                qn, kvn = dims.head_num * d, dims.kv_head_num * d
                q, k, v = (conv.linear(src + m, n, h) for m, n in ((arch.q, qn), (arch.k, kvn), (arch.v, kvn)))
                biases = None
                if dims.qkv_bias:
                    biases = (conv.vector(f"{src}{arch.q}.bias", qn), conv.vector(f"{src}{arch.k}.bias", kvn),
                              conv.vector(f"{src}{arch.v}.bias", kvn))
                attn_norm = conv.vector(f"{src}{arch.attn_norm}.weight", h)
                for r in range(tp):
                    put(r, {f"{dst}attention_norm.weight": attn_norm})
                    put(r, qkv_rank(q, k, v, dims, tp, r).tensors(f"{dst}attention.w_qkv"))
                    if biases is not None:
                        put(r, {f"{dst}attention.w_qkv.bias": qkv_bias_rank(*biases, dims, tp, r)})
                del q, k, v
                bar.advance(task)
                bar.update(task, description=f"layer {i} wo")
                wo = conv.linear(src + arch.o, h, qn)
                for r in range(tp):
                    put(r, row_rank(wo, tp, r).tensors(f"{dst}attention.wo"))
                del wo
                bar.advance(task)
                bar.update(task, description=f"layer {i} w13")
                gate, up = conv.linear(src + arch.gate, dims.inter, h), conv.linear(src + arch.up, dims.inter, h)
                ffn_norm = conv.vector(f"{src}{arch.mlp_norm}.weight", h)
                for r in range(tp):
                    put(r, {f"{dst}ffn_norm.weight": ffn_norm})
                    put(r, w13_rank(gate, up, tp, r).tensors(f"{dst}feed_forward.w13"))
                del gate, up
                bar.advance(task)
                bar.update(task, description=f"layer {i} w2")
                w2 = conv.linear(src + arch.down, h, dims.inter)
                for r in range(tp):
                    put(r, row_rank(w2, tp, r).tensors(f"{dst}feed_forward.w2"))
                bar.advance(task)
        for writer in writers:
            writer.close()
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    return sum(rank_tensors)


def _mkparent(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path

