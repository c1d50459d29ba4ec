"""A source linear as the deploy writer holds it: float [N, K], or int4 in the engine layout ([K/8, N] + [K/g, N]).

The fused tensors (qkv, w13) are concatenated along N here; lmd.workspace_format.rank_layout then cuts each rank's part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatLinear:
    weight: torch.Tensor  # [N, K]

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": self.weight}


@dataclass(frozen=True)
class Int4Linear:
    qweight: torch.Tensor  # int32 [K/8, N]
    scales: torch.Tensor  # [K/g, N]
    zeros: torch.Tensor  # [K/g, N]

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.qweight": self.qweight, f"{prefix}.scales": self.scales, f"{prefix}.zeros": self.zeros}


Linear = FloatLinear | Int4Linear


def cat_n(parts: list[Linear]) -> Linear:
    if isinstance(parts[0], FloatLinear):
        return FloatLinear(torch.cat([p.weight for p in parts], dim=0))  # type: ignore[union-attr]
    return Int4Linear(*(torch.cat([getattr(p, f) for p in parts], dim=1) for f in ("qweight", "scales", "zeros")))


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Zero rows up to padded_rows: their logits are never sampled (the engine masks ids >= vocab_size)."""
    extra = padded_rows - weight.shape[0]
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, weight.shape[1])])
