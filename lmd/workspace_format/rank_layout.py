"""How a workspace's tensors are laid out across tensor-parallel ranks, in both directions (docs/workspace.md).

    column split (N):  attention.w_qkv = [q_r; k_r; v_r]   feed_forward.w13 = [gate_r; up_r]
    row split (K):     attention.wo    feed_forward.w2
    replicated:        embeddings, output, norms, row-split biases (added once, by rank 0) and W8A8 weight_scales
                       (per output channel), the act-order input
                       permutation (`.perm`) of a column-split linear (its input, the hidden state, is whole on every
                       rank); a row-split linear's permutation mixes every rank's channels, so it exists only at TP 1

Rank r of R holds heads [r·H/R, (r+1)·H/R) of q and of k/v, and MLP channels [r·I/R, (r+1)·I/R). N is dim 0 of a
float weight or bias and dim 1 of an int4 qweight/scales/zeros; K is the other one (int4: K/8 qweight rows, K/g
scale rows; a W8A8 weight_scale [N] goes with N). `lmd deploy` cuts rank files with `split_tensor`; the engine
rebuilds the whole model with `merge_ranks` and re-cuts it with `split_ranks` when it runs another TP than the
workspace was deployed with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmd.errors import LmdError

if TYPE_CHECKING:
    import torch

_COLUMN = ("attention.w_qkv", "feed_forward.w13")
_ROW = ("attention.wo", "feed_forward.w2")
_PER_OUTPUT = ("bias", "weight_scale")  # one value per output channel: split with N, whole on every rank of a row split


@dataclass(frozen=True)
class RankShape:
    """The model facts the rank layout depends on; group_size 0 for float weights."""

    head_num: int
    kv_head_num: int
    head_dim: int
    inter_size: int
    group_size: int = 0

    @classmethod
    def of(cls, config: Any) -> RankShape:
        """From a config with config.ini's key names (the workspace's or the engine's model config)."""
        int4 = config.weight_type == "int4"
        return cls(config.head_num, config.kv_head_num, config.size_per_head, config.inter_size,
                   config.group_size if int4 else 0)

    def column_parts(self, module: str, tp: int) -> list[int]:
        """Widths of the fused parts of one rank's column-split linear."""
        if module == "attention.w_qkv":
            d = self.head_dim
            return [self.head_num // tp * d, self.kv_head_num // tp * d, self.kv_head_num // tp * d]
        return [self.inter_size // tp] * 2


def tp_values(shape: RankShape, limit: int = 64) -> list[int]:
    """Every TP that divides the query heads, the KV heads and the MLP width (int4: and keeps each rank's row-split
    input on whole quantization groups)."""
    return [tp for tp in range(1, limit + 1) if _divides(tp, shape)]


def check_tp(tp: int, shape: RankShape, flag: str = "--tp") -> None:
    if tp >= 1 and _divides(tp, shape):
        return
    allowed = ", ".join(str(v) for v in tp_values(shape))
    s = shape
    if tp < 1:
        raise LmdError(f"{flag} {tp} must be >= 1; use {flag} {allowed}")
    if _divides(tp, RankShape(s.head_num, s.kv_head_num, s.head_dim, s.inter_size)):
        raise LmdError(f"{flag} {tp}: the row-split int4 inputs (wo K={s.head_num * s.head_dim}, w2 K={s.inter_size}) "
                       f"divided by {tp} are not multiples of group_size {s.group_size}; use {flag} {allowed}")
    raise LmdError(f"{flag} {tp} does not divide head_num={s.head_num}, kv_head_num={s.kv_head_num} and "
                   f"inter_size={s.inter_size}; use {flag} {allowed}")


def split_tensor(name: str, tensor: torch.Tensor, shape: RankShape, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of a whole-model (tensor_para_size = 1) tensor; a view where the layout allows."""
    import torch

    module, kind = _module_kind(name)
    if tp == 1:
        return tensor
    if kind == "perm":
        return _replicated_perm(name, module, tensor, tp)
    if module in _COLUMN:
        dim = _n_dim(kind)
        whole = [p * tp for p in shape.column_parts(module, tp)]
        parts = [part.chunk(tp, dim=dim)[rank] for part in torch.split(tensor, whole, dim=dim)]
        return torch.cat(parts, dim=dim)
    if module in _ROW and kind not in _PER_OUTPUT:
        return tensor.chunk(tp, dim=_k_dim(kind))[rank]
    return tensor


def split_ranks(tensors: dict[str, torch.Tensor], shape: RankShape, tp: int, rank: int) -> dict[str, torch.Tensor]:
    return {name: split_tensor(name, t, shape, tp, rank) for name, t in tensors.items()}


def merge_ranks(ranks: list[dict[str, torch.Tensor]], shape: RankShape) -> dict[str, torch.Tensor]:
    """Whole-model tensors from every rank's (the inverse of `split_tensor` over all ranks)."""
    import torch

    tp = len(ranks)
    if tp == 1:
        return ranks[0]
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in ranks[0].items():
        module, kind = _module_kind(name)
        if kind == "perm":
            merged[name] = _replicated_perm(name, module, tensor, tp)
        elif module in _COLUMN:
            dim, parts = _n_dim(kind), shape.column_parts(module, tp)
            split = [torch.split(rank[name], parts, dim=dim) for rank in ranks]
            merged[name] = torch.cat([s[i] for i in range(len(parts)) for s in split], dim=dim)
        elif module in _ROW and kind not in _PER_OUTPUT:
            merged[name] = torch.cat([rank[name] for rank in ranks], dim=_k_dim(kind))
        else:
            merged[name] = tensor
    return merged


def _replicated_perm(name: str, module: str, tensor: torch.Tensor, tp: int) -> torch.Tensor:
    if module in _ROW:
        raise LmdError(f"{name}: act-order int4 permutes {module}'s input across every rank's channels; "
                       f"run this workspace at tp 1, not {tp}")
    return tensor


def _divides(tp: int, s: RankShape) -> bool:
    if tp == 1:  # nothing is split (int4 K on whole groups is the source checkpoint's own constraint)
        return True
    if s.head_num % tp or s.kv_head_num % tp or s.inter_size % tp:
        return False
    g = s.group_size
    return not g or ((s.head_num * s.head_dim // tp) % g == 0 and (s.inter_size // tp) % g == 0)


def _module_kind(name: str) -> tuple[str, str]:
    """'layers.3.attention.w_qkv.qweight' -> ('attention.w_qkv', 'qweight'); non-layer tensors -> ('', kind)."""
    linear, _, kind = name.rpartition(".")
    return (linear.split(".", 2)[-1] if linear.startswith("layers.") else ""), kind


def _n_dim(kind: str) -> int:
    return 0 if kind in ("weight", *_PER_OUTPUT) else 1


def _k_dim(kind: str) -> int:
    return 1 if kind == "weight" else 0
