"""A source linear as the deploy writer holds it: float [N, K], W8A8 (8-bit [N, K] + per-channel scales [N]), or
int4 in the engine layout ([K/8, N] + [K/g, N], with the act-order input permutation [K] when the checkpoint has one).

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
    perm: torch.Tensor | None = None  # int32 [K]: engine input channel j reads activation channel perm[j]

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.qweight": self.qweight, f"{prefix}.scales": self.scales, f"{prefix}.zeros": self.zeros}
        if self.perm is not None:
            out[f"{prefix}.perm"] = self.perm
        return out

    def take_n(self, index: torch.Tensor) -> Int4Linear:
        """Output channels reordered: column j of the result is column index[j] of this linear."""
        index = index.long()
        return Int4Linear(self.qweight[:, index], self.scales[:, index], self.zeros[:, index], self.perm)


@dataclass(frozen=True)
class W8A8Linear:
    weight: torch.Tensor  # int8 or float8_e4m3fn [N, K]
    weight_scale: torch.Tensor  # fp32 [N]

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": self.weight, f"{prefix}.weight_scale": self.weight_scale}


Linear = FloatLinear | Int4Linear | W8A8Linear


def same_perm(parts: list[Linear]) -> bool:
    """Fused linears share one input, so they can share one act-order permutation only when theirs are equal."""
    perms = [getattr(p, "perm", None) for p in parts]
    if all(p is None for p in perms):
        return True
    return all(p is not None and torch.equal(p, perms[0]) for p in perms)


def cat_n(parts: list[Linear]) -> Linear:
    if isinstance(parts[0], FloatLinear):
        return FloatLinear(torch.cat([p.weight for p in parts], dim=0))  # type: ignore[union-attr]
    if isinstance(parts[0], W8A8Linear):
        return W8A8Linear(torch.cat([p.weight for p in parts]),  # type: ignore[union-attr]
                          torch.cat([p.weight_scale for p in parts]))  # type: ignore[union-attr]
    if not same_perm(parts):
        raise ValueError("fused int4 linears with different act-order permutations")
    return Int4Linear(*(torch.cat([getattr(p, f) for p in parts], dim=1) for f in ("qweight", "scales", "zeros")),
                      parts[0].perm)  # type: ignore[union-attr]


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Zero rows up to padded_rows: their logits are never sampled (the engine masks ids >= vocab_size)."""
    extra = padded_rows - weight.shape[0]
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, weight.shape[1])])
