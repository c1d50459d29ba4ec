"""Asymmetric per-group int4 quantization of a linear weight (AutoAWQ's zero-point scheme).

For W [out, in] and group size g, every (output row, group of g input channels) gets

    scale = (max - min) / 15          stored in fp16 (the export dtype), min clamped so scale >= 1e-5
    zero  = clamp(round(-min / scale), 0, 15)          an integer zero point
    code  = clamp(round(w / scale) + zero, 0, 15)
    w'    = (code - zero) * scale      the fake-quantized ("dequantized") weight

The scale is rounded to fp16 *before* the codes are computed, so `fake_quantize` equals what a reader of the exported
fp16 scales reconstructs, bit for bit in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_CODE = 15  # 4-bit unsigned codes 0..15
SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized linear weight W [out, in] (the transpose of AutoAWQ's [in, out] tensors)."""

    codes: torch.Tensor  # uint8 [out, in], 0..15
    zeros: torch.Tensor  # uint8 [out, in // g], 0..15
    scales: torch.Tensor  # fp16 [out, in // g]
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, inp = self.codes.shape
        groups = inp // self.group_size
        codes = self.codes.to(torch.float32).view(out, groups, self.group_size)
        zeros = self.zeros.to(torch.float32).unsqueeze(-1)
        scales = self.scales.to(torch.float32).unsqueeze(-1)
        return ((codes - zeros) * scales).view(out, inp).to(dtype)


def _group_params(grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped fp32 [..., g] -> (scale [..., 1] fp16-representable, integer zero [..., 1])."""
    wmax = grouped.amax(dim=-1, keepdim=True)
    wmin = grouped.amin(dim=-1, keepdim=True)
    scale = ((wmax - wmin).clamp(min=1e-5) / MAX_CODE).to(SCALE_DTYPE).to(torch.float32)
    zero = torch.round(-wmin / scale).clamp(0, MAX_CODE)
    return scale, zero


def quantize_weight(w: torch.Tensor, group_size: int) -> QuantizedWeight:
    scale, zero = min_max_params(w, group_size)
    return quantize_with_params(w, scale, zero, group_size)


def min_max_params(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> the min-max (scale, zero) per (row, group), both fp32 [out, in // g] (scale fp16-representable)."""
    out, inp = w.shape
    scale, zero = _group_params(w.to(torch.float32).reshape(out, inp // group_size, group_size))
    return scale.squeeze(-1), zero.squeeze(-1)


def quantize_with_params(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> QuantizedWeight:
    """Round W [out, in] to the given per-group grid (scale, zero [out, in // g]); out-of-range values saturate."""
    out, inp = w.shape
    grouped = w.to(torch.float32).reshape(out, inp // group_size, group_size)
    scale = scale.to(SCALE_DTYPE).to(torch.float32).unsqueeze(-1)
    zero = zero.to(torch.float32).unsqueeze(-1)
    codes = torch.clamp(torch.round(grouped / scale) + zero, 0, MAX_CODE)
    return QuantizedWeight(
        codes=codes.reshape(out, inp).to(torch.uint8),
        zeros=zero.squeeze(-1).to(torch.uint8),
        scales=scale.squeeze(-1).to(SCALE_DTYPE),
        group_size=group_size,
    )


def fake_quantize_groups(grouped: torch.Tensor) -> torch.Tensor:
    """Quantize and dequantize along the last dim (one group per row of g values); returns fp32."""
    grouped = grouped.to(torch.float32)
    scale, zero = _group_params(grouped)
    return (torch.clamp(torch.round(grouped / scale) + zero, 0, MAX_CODE) - zero) * scale


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [out, in] -> dequantize(quantize(W)) in w's dtype (the search loops' hot path)."""
    out, inp = w.shape
    return fake_quantize_groups(w.reshape(out, inp // group_size, group_size)).reshape(out, inp).to(w.dtype)


def fitting_group_sizes(in_features: int, candidates: tuple[int, ...]) -> list[int]:
    return [g for g in candidates if in_features % g == 0]
