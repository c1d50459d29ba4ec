"""Read a workspace back: its config, one rank's tensors, or the whole model as an HF-named state dict.

`reconstruct_hf_state_dict` undoes the TP split and QKV / gate-up fusion (int4 linears come back dequantized), which
is how the deploy round trip is tested without the engine.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmd.arch import ARCHITECTURES, ArchSpec
from lmd.deploy.workspace_config import WorkspaceConfig, rank_weights_path, read_workspace_config
from lmd.errors import LmdError
from lmd.turbomind.kernels.w4a16_layout import dequantize

__all__ = ["load_rank_tensors", "read_workspace_config", "reconstruct_hf_state_dict"]


def load_rank_tensors(workspace: str | Path, rank: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = rank_weights_path(workspace, rank)
    if not path.is_file():
        raise LmdError(f"{path} does not exist; the workspace is incomplete (re-run lmd deploy)")
    try:
        return load_file(str(path), device=device)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise LmdError(f"{path}: cannot read ({str(exc).splitlines()[0]}); re-run lmd deploy") from None


def _arch(cfg: WorkspaceConfig) -> ArchSpec:
    if cfg.model_arch not in ARCHITECTURES:
        raise LmdError(f"config.ini: model_arch={cfg.model_arch} is not one of {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[cfg.model_arch]


def _dense(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """[N, K] weight of one rank's linear: stored as-is for float types, dequantized (in fp32) for int4."""
    if f"{prefix}.weight" in tensors:
        return tensors[f"{prefix}.weight"]
    qweight, scales, zeros = (tensors[f"{prefix}.{n}"] for n in ("qweight", "scales", "zeros"))
    return dequantize(qweight, scales.float(), zeros.float()).t()


def reconstruct_hf_state_dict(workspace: str | Path) -> dict[str, torch.Tensor]:
    """HF-named tensors of the whole model (ranks merged, vocab padding removed, int4 dequantized to fp32)."""
    cfg = read_workspace_config(workspace)
    arch = _arch(cfg)
    tp, d = cfg.tensor_para_size, cfg.size_per_head
    ranks = [load_rank_tensors(workspace, r) for r in range(tp)]
    first = ranks[0]
    out = {f"{arch.embed}.weight": first["tok_embeddings.weight"][: cfg.vocab_size],
           f"{arch.final_norm}.weight": first["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out[f"{arch.lm_head}.weight"] = first["output.weight"][: cfg.vocab_size]
    hq, hkv = cfg.head_num // tp * d, cfg.kv_head_num // tp * d
    for i in range(cfg.num_layer):
        src, hf = f"layers.{i}.", f"{arch.layers}.{i}."
        out[f"{hf}{arch.attn_norm}.weight"] = first[f"{src}attention_norm.weight"]
        out[f"{hf}{arch.mlp_norm}.weight"] = first[f"{src}ffn_norm.weight"]
        qkv = [_dense(t, f"{src}attention.w_qkv").split([hq, hkv, hkv]) for t in ranks]
        for j, module in enumerate((arch.q, arch.k, arch.v)):
            out[f"{hf}{module}.weight"] = torch.cat([parts[j] for parts in qkv])
        if cfg.attn_bias:
            biases = [t[f"{src}attention.w_qkv.bias"].split([hq, hkv, hkv]) for t in ranks]
            for j, module in enumerate((arch.q, arch.k, arch.v)):
                out[f"{hf}{module}.bias"] = torch.cat([parts[j] for parts in biases])
        inter = cfg.inter_size // tp
        w13 = [_dense(t, f"{src}feed_forward.w13").split([inter, inter]) for t in ranks]
        out[f"{hf}{arch.gate}.weight"] = torch.cat([parts[0] for parts in w13])
        out[f"{hf}{arch.up}.weight"] = torch.cat([parts[1] for parts in w13])
        out[f"{hf}{arch.o}.weight"] = torch.cat([_dense(t, f"{src}attention.wo") for t in ranks], dim=1)
        out[f"{hf}{arch.down}.weight"] = torch.cat([_dense(t, f"{src}feed_forward.w2") for t in ranks], dim=1)
    return out
