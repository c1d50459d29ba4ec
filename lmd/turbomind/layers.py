"""Norm and MLP of a Llama-family decoder layer, computed as transformers does (RMSNorm in fp32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmd.turbomind.linear import Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class GatedMLP:
    """w2(silu(gate) * up) with gate and up fused in w13 (gate rows first)."""

    def __init__(self, w13: Linear, w2: Linear) -> None:
        self.w13, self.w2 = w13, w2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)
