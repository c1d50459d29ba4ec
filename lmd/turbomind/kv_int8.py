"""KV int8 (quant_policy = 4): asymmetric 8-bit codes per (token, head) over the head dim.

    q = clamp(round((x - zero) / scale), -128, 127)        x ≈ q * scale + zero

Static parameters (`lmd kv-qparams`, docs/workspace.md) are one (scale, zero) per layer and KV head, or per layer, KV
head and head-dim channel (`--per-channel`; keys after RoPE have a few wide channels). Online parameters
are computed per token and head at write time, zero = (min + max) / 2, scale ≈ (max - min) / 255, and are stored in
fp16 beside the codes; the codes are made with the fp16-rounded parameters so that dequantization is consistent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmd.errors import LmdError


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; scale/zero broadcastable to [T, H, 1] -> int8 codes."""
    return torch.clamp(torch.round((x.float() - zero.float()) / scale.float()), -128, 127).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float() + zero.float()).to(dtype)


def online_params(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> scale, zero [T, H] in fp16 (per-token, per-head asymmetric)."""
    xf = x.float()
    hi, lo = xf.amax(dim=-1), xf.amin(dim=-1)
    zero = ((hi + lo) / 2.0).to(torch.float16)
    # The stored zero is rounded to fp16; widen the step so [lo, hi] still maps inside [-127.5, 127.5] steps, and
    # round the step up, never down, to fp16.
    reach = torch.maximum(hi - zero.float(), zero.float() - lo)
    scale = (reach / 127.5).clamp(min=6.2e-5) * (1 + 2.0 ** -10)
    return scale.to(torch.float16), zero


@dataclass(frozen=True)
class StaticKVParams:
    """Per layer: k_scale, k_zero, v_scale, v_zero, each fp32 [Hkv, 1] (per head) or [Hkv, D] (per channel), so they
    broadcast against [T, Hkv, D]."""

    k_scale: tuple[torch.Tensor, ...]
    k_zero: tuple[torch.Tensor, ...]
    v_scale: tuple[torch.Tensor, ...]
    v_zero: tuple[torch.Tensor, ...]

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], num_layers: int, kv_heads: int, head_dim: int,
                     source: str) -> StaticKVParams:
        columns: dict[str, list[torch.Tensor]] = {"k_scale": [], "k_zero": [], "v_scale": [], "v_zero": []}
        for i in range(num_layers):
            for name, column in columns.items():
                key = f"layers.{i}.{name}"
                if key not in tensors:
                    raise LmdError(f"{source}: missing {key}; rerun `lmd kv-qparams` for this workspace")
                t = tensors[key].float().reshape(-1)
                if t.numel() not in (kv_heads, kv_heads * head_dim):
                    raise LmdError(f"{source}: {key} has {t.numel()} values, expected {kv_heads} (one per KV head) or "
                                   f"{kv_heads * head_dim} (per KV head and channel); rerun `lmd kv-qparams`")
                column.append(t.reshape(kv_heads, -1))
        if any((s <= 0).any() for s in columns["k_scale"] + columns["v_scale"]):
            raise LmdError(f"{source}: a scale is <= 0; rerun `lmd kv-qparams`")
        return cls(*(tuple(columns[n]) for n in ("k_scale", "k_zero", "v_scale", "v_zero")))
