"""int4 weights as every source format can state them, and their conversion into the engine's layout.

GPTQ, compressed-tensors and AWQ checkpoints all describe a linear W [N, K] by integer codes q[k, n] in 0..15, a
group g_idx[k] per input channel and, per (group, output channel), a scale s and an integer zero point z:

    W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

The engine (lmd/turbomind/kernels/w4a16_layout.py) needs groups of `group_size` *consecutive* input channels.
Act-order (GPTQ desc_act, compressed-tensors actorder=group) gives channels to groups in another order, so
`to_engine` sorts the input channels by group (a stable argsort of g_idx) and returns that permutation: the engine
gathers the activation's channels in the same order before the GEMM (x[..., perm] @ W[:, perm].T == x @ W.T, exactly).
A checkpoint group wider than the engine's (per-channel, group_size -1) is cut into engine groups that repeat its
scale and zero, which is exact too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmd.turbomind.kernels.w4a16_layout import pack_codes_along_k

NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


@dataclass(frozen=True)
class Int4Codes:
    codes: torch.Tensor  # int32 [K, N], 0..15
    scales: torch.Tensor  # fp32 [G, N]
    zeros: torch.Tensor  # fp32 [G, N]: the integer zero point z (not folded)
    g_idx: torch.Tensor  # int64 [K]: the group of each input channel

    def dequantize(self) -> torch.Tensor:
        """W [N, K] in fp32 by the formula above; the oracle the engine layout is tested against."""
        g = self.g_idx.long()
        return ((self.codes.float() - self.zeros[g]) * self.scales[g]).t()


@dataclass(frozen=True)
class EngineInt4:
    qweight: torch.Tensor  # int32 [K/8, N], input channels in `perm` order
    scales: torch.Tensor  # [K/g, N]
    zeros: torch.Tensor  # [K/g, N], folded as -z * s
    perm: torch.Tensor | None  # int32 [K]: engine input channel j is source channel perm[j]; None = identity


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 tensor with eight 4-bit values per element along `dim`, low nibble first -> int32 values 0..15 with
    that dim eight times longer (value i of element j lands at 8j + i)."""
    moved = packed.movedim(dim, -1).to(torch.int64)
    nibbles = (moved.unsqueeze(-1) >> NIBBLE_SHIFTS.to(packed.device)) & 0xF
    return nibbles.reshape(*moved.shape[:-1], moved.shape[-1] * 8).movedim(-1, dim).to(torch.int32)


def is_contiguous_grouping(g_idx: torch.Tensor, num_groups: int) -> bool:
    k = g_idx.numel()
    return bool(torch.equal(g_idx.long().cpu(), torch.arange(k) // (k // num_groups)))


def to_engine(source: Int4Codes, group_size: int, dtype: torch.dtype) -> EngineInt4:
    """Engine tensors of one linear; ValueError when the grouping cannot be expressed by groups of group_size."""
    k, n = source.codes.shape
    groups = source.scales.shape[0]
    if k % groups or source.zeros.shape != source.scales.shape or source.g_idx.shape != (k,):
        raise ValueError(f"codes [{k}, {n}], scales {list(source.scales.shape)}, zeros {list(source.zeros.shape)} "
                         f"and g_idx {list(source.g_idx.shape)} do not describe one grouped int4 linear")
    width = k // groups
    codes, perm = source.codes, None
    if not is_contiguous_grouping(source.g_idx, groups):
        order = torch.argsort(source.g_idx.long().cpu(), stable=True)
        if not torch.equal(source.g_idx.long().cpu()[order], torch.arange(k) // width):
            raise ValueError(f"g_idx does not give each of the {groups} groups exactly {width} input channels")
        codes, perm = codes[order], order.to(torch.int32)
    if width % group_size:
        raise ValueError(f"checkpoint groups of {width} input channels cannot be cut into engine groups of "
                         f"{group_size}")
    repeat = width // group_size
    s = source.scales.float().repeat_interleave(repeat, dim=0)
    z = source.zeros.float().repeat_interleave(repeat, dim=0)
    return EngineInt4(pack_codes_along_k(codes), s.to(dtype), (-z * s).to(dtype), perm)
