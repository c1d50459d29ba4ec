"""Rebuild whole-model tensors from the rank files of a tensor-parallel workspace, to run it in one process.

Layout per rank (docs/workspace.md): w_qkv = [q_r; k_r; v_r] and w13 = [gate_r; up_r] along N (column split);
wo and w2 split along K (row split). Merging takes every rank's q, then every rank's k, then every v (gate, up alike),
and concatenates the row-split tensors along K. N is dim 0 of a float weight and dim 1 of an int4 qweight/scales/zeros;
K is the other one.
"""

from __future__ import annotations

import torch

from lmd.turbomind.config import ModelConfig

_COLUMN = ("attention.w_qkv", "feed_forward.w13")
_ROW = ("attention.wo", "feed_forward.w2")


def merge_ranks(cfg: ModelConfig, ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    r = len(ranks)
    d = cfg.size_per_head
    qkv_parts = [cfg.head_num // r * d, cfg.kv_head_num // r * d, cfg.kv_head_num // r * d]
    w13_parts = [cfg.inter_size // r] * 2
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in ranks[0].items():
        linear, _, kind = name.rpartition(".")
        module = linear.split(".", 2)[-1] if linear.startswith("layers.") else ""
        if module in _COLUMN:
            parts = qkv_parts if module == "attention.w_qkv" else w13_parts
            n_dim = 0 if kind in ("weight", "bias") else 1
            split = [torch.split(rank[name], parts, dim=n_dim) for rank in ranks]
            merged[name] = torch.cat([s[i] for i in range(len(parts)) for s in split], dim=n_dim)
        elif module in _ROW and kind != "bias":
            k_dim = 1 if kind == "weight" else 0
            merged[name] = torch.cat([rank[name] for rank in ranks], dim=k_dim)
        else:
            merged[name] = tensor
    return merged
