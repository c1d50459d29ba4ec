"""Source tensors (HF names) -> `model.rank{r}.safetensors` (workspace names), one decoder layer at a time.

Each source linear is read once (an int4 one converted once by lmd.deploy.int4_readers), fused (qkv, gate/up) into
the whole-model tensor, then every rank's part is cut from it by the format's rank layout and streamed to that rank's
file; only one layer's tensors are alive at a time.

Act-order int4: fused linears share one input permutation (GPTQ gives q/k/v, and gate/up, the same one: they see the
same inputs); w2's is folded into w13's output rows (gate and up permuted alike, so silu(gate) * up comes out in w2's
order), leaving runtime gathers only before w_qkv, wo and w13.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmd.arch import ArchSpec
from lmd.deploy.config_from_hf import ModelDims
from lmd.deploy.int4_readers import read_int4_linear
from lmd.deploy.int4_schemes import Int4Scheme
from lmd.deploy.linears import FloatLinear, Int4Linear, Linear, cat_n, pad_vocab, same_perm
from lmd.deploy.safetensors_stream import SafetensorsStreamWriter
from lmd.deploy.source_weights import TensorReader
from lmd.deploy.w8a8_checkpoint import read_w8a8_linear
from lmd.errors import LmdError
from lmd.workspace_format.config_ini import WorkspaceConfig, rank_weights_path
from lmd.workspace_format.rank_layout import split_ranks


def cast_checked(tensor: torch.Tensor, dtype: torch.dtype, name: str, where: str) -> torch.Tensor:
    """Cast, refusing values that fp16 cannot hold (bf16 / fp32 sources); one min/max pass, no temporaries."""
    if dtype == torch.float16 and tensor.dtype in (torch.float32, torch.bfloat16) and tensor.numel():
        low, high = torch.aminmax(tensor)
        if max(-float(low), float(high)) > torch.finfo(torch.float16).max:
            raise LmdError(f"{where}: tensor {name} has values beyond float16's range; deploy with --dtype bfloat16")
    return tensor.to(dtype)


class WeightWriter:
    def __init__(self, workspace: Path, reader: TensorReader, arch: ArchSpec, cfg: WorkspaceConfig, dims: ModelDims,
                 dtype: torch.dtype, scheme: Int4Scheme | None = None) -> None:
        self.reader, self.arch, self.cfg, self.dims, self.dtype, self.scheme = reader, arch, cfg, dims, dtype, scheme
        self.tp = cfg.tensor_para_size
        rank_weights_path(workspace, 0).parent.mkdir(parents=True, exist_ok=True)
        self.files = [SafetensorsStreamWriter(rank_weights_path(workspace, r),
                                              {"format": "pt", "rank": str(r), "tensor_para_size": str(self.tp)})
                      for r in range(self.tp)]
        self.num_tensors = 0

    # -- reading ---------------------------------------------------------------------------------------------------
    def vector(self, name: str, size: int) -> torch.Tensor:
        return cast_checked(self.reader.get(name, (size,)), self.dtype, name, self.reader.where)

    def matrix(self, name: str, rows: int, cols: int) -> torch.Tensor:
        return cast_checked(self.reader.get(name, (rows, cols)), self.dtype, name, self.reader.where)

    def linear(self, module: str, n: int, k: int) -> Linear:
        """W [n, k] as a float linear, or the int4 tensors of the module converted into the engine's int4 layout."""
        if self.cfg.weight_type in ("int8", "fp8"):
            return read_w8a8_linear(self.reader, module, n, k, self.cfg.weight_type)
        if self.cfg.weight_type != "int4":
            return FloatLinear(self.matrix(f"{module}.weight", n, k))
        assert self.scheme is not None
        return read_int4_linear(self.reader, self.scheme, module, n, k, self.cfg.group_size, self.dtype)

    def fused(self, prefix: str, modules: list[str], parts: list[Linear]) -> Linear:
        if not same_perm(parts):
            raise LmdError(f"{self.reader.where}: {prefix}{{{','.join(modules)}}} have different act-order g_idx but "
                           "share one input; lmd serves them fused with one permutation (re-quantize them together)")
        return cat_n(parts)

    # -- writing ---------------------------------------------------------------------------------------------------
    def put(self, rank: int, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.files[rank].add(name, tensor)
            self.num_tensors += 1

    def put_all_ranks(self, tensors: dict[str, torch.Tensor]) -> None:
        for rank in range(self.tp):
            self.put(rank, tensors)

    def put_split(self, tensors: dict[str, torch.Tensor]) -> None:
        """Whole-model tensors, each rank's part to its file."""
        for rank in range(self.tp):
            self.put(rank, split_ranks(tensors, self.cfg.rank_shape, self.tp, rank))

    def write_embeddings(self) -> None:
        arch, dims, rows = self.arch, self.dims, self.cfg.padded_vocab_size
        self.put_all_ranks({"tok_embeddings.weight": pad_vocab(self.matrix(f"{arch.embed}.weight", dims.vocab,
                                                                           dims.hidden), rows),
                            "norm.weight": self.vector(f"{arch.final_norm}.weight", dims.hidden)})
        if not dims.tie_word_embeddings:
            output = self.matrix(f"{arch.lm_head}.weight", dims.vocab, dims.hidden)
            self.put_all_ranks({"output.weight": pad_vocab(output, rows)})

    def write_attention(self, i: int) -> None:
        arch, dims, h = self.arch, self.dims, self.dims.hidden
        src, dst = f"{arch.layers}.{i}.", f"layers.{i}."
        self._check_no_extra_bias(src)
        qn, kvn = dims.head_num * dims.head_dim, dims.kv_head_num * dims.head_dim
        if arch.qkv:  # fused in the checkpoint already, rows q, k, v as the workspace wants them
            qkv = self.linear(src + arch.qkv, qn + 2 * kvn, h)
            bias = (self.vector(f"{src}{arch.qkv}.bias", qn + 2 * kvn),) if dims.qkv_bias else None
        else:
            parts = [self.linear(src + m, n, h) for m, n in ((arch.q, qn), (arch.k, kvn), (arch.v, kvn))]
            qkv = self.fused(src, [arch.q, arch.k, arch.v], parts)
            del parts
            bias = None
            if dims.qkv_bias:
                bias = tuple(self.vector(f"{src}{m}.bias", n) for m, n in ((arch.q, qn), (arch.k, kvn), (arch.v, kvn)))
        self.put_all_ranks({f"{dst}attention_norm.weight": self.vector(f"{src}{arch.attn_norm}.weight", h)})
        if dims.qk_norm:  # one [head_dim] weight for every head: whole on every rank
            self.put_all_ranks({f"{dst}attention.{n}_norm.weight": self.vector(f"{src}{m}.weight", dims.head_dim)
                                for n, m in (("q", arch.q_norm), ("k", arch.k_norm))})
        self.put_split(qkv.tensors(f"{dst}attention.w_qkv"))
        if bias is not None:
            self.put_split({f"{dst}attention.w_qkv.bias": torch.cat(bias)})
        del qkv
        self.put_split(self.linear(src + arch.o, h, qn).tensors(f"{dst}attention.wo"))

    def write_mlp(self, i: int) -> None:
        arch, dims, h = self.arch, self.dims, self.dims.hidden
        src, dst = f"{arch.layers}.{i}.", f"layers.{i}."
        self.put_all_ranks({f"{dst}ffn_norm.weight": self.vector(f"{src}{arch.mlp_norm}.weight", h)})
        if arch.gate_up:  # fused in the checkpoint already, rows gate, up
            w13 = self.linear(src + arch.gate_up, 2 * dims.inter, h)
        else:
            parts = [self.linear(src + arch.gate, dims.inter, h), self.linear(src + arch.up, dims.inter, h)]
            w13 = self.fused(src, [arch.gate, arch.up], parts)
            del parts
        down = self.linear(src + arch.down, h, dims.inter)
        if isinstance(down, Int4Linear) and down.perm is not None:  # gate and up rows reordered alike
            if not isinstance(w13, Int4Linear):
                raise LmdError(f"{self.reader.where}: {src}{arch.down} is act-order int4 but gate/up are not int4; "
                               "re-quantize the MLP's linears together")
            w13 = w13.take_n(torch.cat([down.perm, down.perm + dims.inter]))
            down = Int4Linear(down.qweight, down.scales, down.zeros)
        self.put_split(w13.tensors(f"{dst}feed_forward.w13"))
        del w13
        self.put_split(down.tensors(f"{dst}feed_forward.w2"))

    def _check_no_extra_bias(self, prefix: str) -> None:
        mlp = (self.arch.gate_up,) if self.arch.gate_up else (self.arch.gate, self.arch.up)
        for module in (self.arch.o, *mlp, self.arch.down):
            if self.reader.has(f"{prefix}{module}.bias"):
                raise LmdError(f"{self.reader.where}: {prefix}{module}.bias is not supported by the workspace format "
                               "(only the fused QKV may have a bias)")

    def close(self) -> None:
        for file in self.files:
            file.close()

    def abort(self) -> None:
        for file in self.files:
            file.abort()


def write_weights(workspace: Path, reader: TensorReader, arch: ArchSpec, cfg: WorkspaceConfig, dims: ModelDims,
                  dtype: torch.dtype, progress: bool, scheme: Int4Scheme | None = None) -> int:
    """Write every rank file; returns the number of tensors written (all ranks together)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    writer = WeightWriter(workspace, reader, arch, cfg, dims, dtype, scheme)
    bar = Progress(TextColumn("[bold]deploy[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True, disable=not progress)
    try:
        with bar:
            task = bar.add_task("embeddings", total=1 + 2 * dims.num_layer)
            writer.write_embeddings()
            bar.advance(task)
            for i in range(dims.num_layer):
                bar.update(task, description=f"layer {i} attention")
                writer.write_attention(i)
                bar.advance(task)
                bar.update(task, description=f"layer {i} mlp")
                writer.write_mlp(i)
                bar.advance(task)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return writer.num_tensors
