"""Read a workspace back: its config, one rank's tensors, or the whole model as an HF-named state dict.

`reconstruct_hf_state_dict` undoes the TP split and QKV / gate-up fusion (int4 linears come back dequantized), which
is how the deploy round trip is tested without the engine. An act-order checkpoint comes back as an equivalent model,
not the same tensors: deploy folds down_proj's input permutation into gate/up's output rows (the MLP's hidden
channels are reordered alike on both sides), and every other permutation is undone here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmd.arch import ARCHITECTURES, ArchSpec
from lmd.errors import LmdError
from lmd.turbomind.kernels.w4a16_layout import dequantize
from lmd.workspace_format.config_ini import WorkspaceConfig, rank_weights_path, read_workspace_config
from lmd.workspace_format.rank_layout import merge_ranks

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
    """[N, K] weight of a linear: stored as-is for float types, dequantized (in fp32) for int4 and W8A8."""
    if f"{prefix}.weight_scale" in tensors:  # W8A8: 8-bit weight times its per-channel scale
        return tensors[f"{prefix}.weight"].float() * tensors[f"{prefix}.weight_scale"].float()[:, None]
    if f"{prefix}.weight" in tensors:
        return tensors[f"{prefix}.weight"]
    qweight, scales, zeros = (tensors[f"{prefix}.{n}"] for n in ("qweight", "scales", "zeros"))
    weight = dequantize(qweight, scales.float(), zeros.float()).t()
    perm = tensors.get(f"{prefix}.perm")
    if perm is None:
        return weight
    natural = torch.empty_like(weight)
    natural[:, perm.long()] = weight  # stored input channel j is the model's channel perm[j]
    return natural


def reconstruct_hf_state_dict(workspace: str | Path) -> dict[str, torch.Tensor]:
    """HF-named tensors of the whole model (ranks merged, vocab padding removed, int4 dequantized to fp32)."""
    cfg = read_workspace_config(workspace)
    arch = _arch(cfg)
    d = cfg.size_per_head
    whole = merge_ranks([load_rank_tensors(workspace, r) for r in range(cfg.tensor_para_size)], cfg.rank_shape)
    out = {f"{arch.embed}.weight": whole["tok_embeddings.weight"][: cfg.vocab_size],
           f"{arch.final_norm}.weight": whole["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out[f"{arch.lm_head}.weight"] = whole["output.weight"][: cfg.vocab_size]
    qkv_parts = [cfg.head_num * d, cfg.kv_head_num * d, cfg.kv_head_num * d]
    for i in range(cfg.num_layer):
        src, hf = f"layers.{i}.", f"{arch.layers}.{i}."
        out[f"{hf}{arch.attn_norm}.weight"] = whole[f"{src}attention_norm.weight"]
        out[f"{hf}{arch.mlp_norm}.weight"] = whole[f"{src}ffn_norm.weight"]
        if cfg.qk_norm:
            out[f"{hf}{arch.q_norm}.weight"] = whole[f"{src}attention.q_norm.weight"]
            out[f"{hf}{arch.k_norm}.weight"] = whole[f"{src}attention.k_norm.weight"]
        qkv, w13 = _dense(whole, f"{src}attention.w_qkv"), _dense(whole, f"{src}feed_forward.w13")
        if arch.qkv:
            out[f"{hf}{arch.qkv}.weight"] = qkv
            if cfg.attn_bias:
                out[f"{hf}{arch.qkv}.bias"] = whole[f"{src}attention.w_qkv.bias"]
        else:
            for module, part in zip((arch.q, arch.k, arch.v), qkv.split(qkv_parts), strict=True):
                out[f"{hf}{module}.weight"] = part
            if cfg.attn_bias:
                for module, part in zip((arch.q, arch.k, arch.v), whole[f"{src}attention.w_qkv.bias"].split(qkv_parts),
                                        strict=True):
                    out[f"{hf}{module}.bias"] = part
        if arch.gate_up:
            out[f"{hf}{arch.gate_up}.weight"] = w13
        else:
            out[f"{hf}{arch.gate}.weight"], out[f"{hf}{arch.up}.weight"] = w13.chunk(2)
        out[f"{hf}{arch.o}.weight"] = _dense(whole, f"{src}attention.wo")
        out[f"{hf}{arch.down}.weight"] = _dense(whole, f"{src}feed_forward.w2")
    return out
