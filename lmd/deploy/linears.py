"""Tensor-parallel slicing of linears at convert time, for float [N, K] and engine int4 ([K/8, N] + [K/g, N]) alike.

Column split (qkv, w13) cuts output channels N; row split (wo, w2) cuts input channels K. Fused tensors are built per
rank: rank r's qkv is its q heads, then its k heads, then its v heads, so each rank's attention is self-contained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmd.deploy.config_from_hf import ModelDims
from lmd.errors import LmdError


@dataclass(frozen=True)
class FloatLinear:
    weight: torch.Tensor  # [N, K]

    def slice_n(self, start: int, stop: int) -> FloatLinear:
        return FloatLinear(self.weight[start:stop])

    def slice_k(self, start: int, stop: int) -> FloatLinear:
        return FloatLinear(self.weight[:, start:stop])

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": self.weight}


@dataclass(frozen=True)
class Int4Linear:
    qweight: torch.Tensor  # int32 [K/8, N]
    scales: torch.Tensor  # [K/g, N]
    zeros: torch.Tensor  # [K/g, N]

    @property
    def group_size(self) -> int:
        return self.qweight.shape[0] * 8 // self.scales.shape[0]

    def slice_n(self, start: int, stop: int) -> Int4Linear:
        return Int4Linear(self.qweight[:, start:stop], self.scales[:, start:stop], self.zeros[:, start:stop])

    def slice_k(self, start: int, stop: int) -> Int4Linear:
        g = self.group_size
        assert start % g == 0 and stop % g == 0, "row split must cut at group boundaries (checked by check_tp)"
        return Int4Linear(self.qweight[start // 8:stop // 8], self.scales[start // g:stop // g],
                          self.zeros[start // g:stop // g])

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.qweight": self.qweight, f"{prefix}.scales": self.scales, f"{prefix}.zeros": self.zeros}


Linear = FloatLinear | Int4Linear


def cat_n(parts: list[Linear]) -> Linear:
    if isinstance(parts[0], FloatLinear):
        return FloatLinear(torch.cat([p.weight for p in parts], dim=0))  # type: ignore[union-attr]
    return Int4Linear(*(torch.cat([getattr(p, f) for p in parts], dim=1) for f in ("qweight", "scales", "zeros")))


def valid_tp_values(dims: ModelDims, group_size: int = 0, limit: int = 64) -> list[int]:
    """Powers of two that divide the head counts and the MLP width (and keep row-split int4 K on group boundaries)."""
    values = []
    tp = 1
    while tp <= limit:
        ok = dims.head_num % tp == 0 and dims.kv_head_num % tp == 0 and dims.inter % tp == 0
        if ok and group_size:
            ok = (dims.head_num * dims.head_dim // tp) % group_size == 0 and (dims.inter // tp) % group_size == 0
        if ok:
            values.append(tp)
        tp *= 2
    return values


def check_tp(tp: int, dims: ModelDims, group_size: int = 0) -> None:
    valid = valid_tp_values(dims, group_size)
    if tp in valid:
        return
    allowed = ", ".join(str(v) for v in valid)
    if tp < 1 or tp & (tp - 1):
        raise LmdError(f"--tp {tp} must be a power of two; valid for this model: {allowed}")
    if group_size and tp in valid_tp_values(dims):
        raise LmdError(f"--tp {tp}: the row-split int4 inputs (wo K={dims.head_num * dims.head_dim}, w2 K={dims.inter}) "
                       f"divided by {tp} are not multiples of group_size {group_size}; use --tp {allowed}")
    raise LmdError(f"--tp {tp} does not divide head_num={dims.head_num}, kv_head_num={dims.kv_head_num} and "
                   f"inter_size={dims.inter}; use --tp {allowed}")


def qkv_rank(q: Linear, k: Linear, v: Linear, dims: ModelDims, tp: int, rank: int) -> Linear:
    qn = dims.head_num // tp * dims.head_dim
    kvn = dims.kv_head_num // tp * dims.head_dim
    return cat_n([q.slice_n(rank * qn, (rank + 1) * qn), k.slice_n(rank * kvn, (rank + 1) * kvn),
                  v.slice_n(rank * kvn, (rank + 1) * kvn)])


def qkv_bias_rank(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: ModelDims, tp: int, rank: int) -> torch.Tensor:
    qn = dims.head_num // tp * dims.head_dim
    kvn = dims.kv_head_num // tp * dims.head_dim
    return torch.cat([q[rank * qn:(rank + 1) * qn], k[rank * kvn:(rank + 1) * kvn], v[rank * kvn:(rank + 1) * kvn]])


def w13_rank(gate: Linear, up: Linear, tp: int, rank: int) -> Linear:
    n = _out_features(gate) // tp
    return cat_n([gate.slice_n(rank * n, (rank + 1) * n), up.slice_n(rank * n, (rank + 1) * n)])


def row_rank(linear: Linear, tp: int, rank: int) -> Linear:
    k = _in_features(linear) // tp
    return linear.slice_k(rank * k, (rank + 1) * k)


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Zero rows up to padded_rows: their logits are never sampled (the engine masks ids >= vocab_size)."""
    extra = padded_rows - weight.shape[0]
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, weight.shape[1])])


def _out_features(linear: Linear) -> int:
    return linear.weight.shape[0] if isinstance(linear, FloatLinear) else linear.qweight.shape[1]


def _in_features(linear: Linear) -> int:
    return linear.weight.shape[1] if isinstance(linear, FloatLinear) else linear.qweight.shape[0] * 8
