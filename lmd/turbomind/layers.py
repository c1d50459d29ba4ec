"""Norm and MLP of a Llama-family decoder layer, computed as transformers does (RMSNorm in fp32).

`add_rms_norm` and `silu_mul` are dispatch points: their Triton kernels (lmd/turbomind/kernels/rms_norm.py,
silu_mul.py) run on CUDA by default (LMD_LAYER_OPS, see kernel_choice); the `*_reference` functions here are the CPU
path and the kernels' test oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmd.turbomind.kernel_choice import layer_kernel
from lmd.turbomind.linear import Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)); delta None: (h, rms_norm(h))."""
    if delta is not None:
        h = h + delta
    return h, rms_norm(h, weight, eps)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding `delta`, and its RMSNorm (one kernel on CUDA)."""
    kernel = layer_kernel(h, "rms_norm")
    if (kernel is not None and h.dim() == 2 and h.stride(-1) == 1 and h.shape[-1] <= kernel.MAX_HIDDEN
            and (delta is None or delta.stride(-1) == 1)):
        return kernel.add_rms_norm_triton(h, delta, weight, eps)
    return add_rms_norm_reference(h, delta, weight, eps)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused projection [T, 2I] (gate columns first) -> [T, I]."""
    kernel = layer_kernel(gate_up, "silu_mul")
    if kernel is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return kernel.silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)


class GatedMLP:
    """w2(silu(gate) * up) with gate and up fused in w13 (gate rows first)."""

    def __init__(self, w13: Linear, w2: Linear) -> None:
        self.w13, self.w2 = w13, w2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(silu_mul(self.w13(x)))


def qk_rms_norm_reference(qkv: torch.Tensor, weight: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int,
                          eps: float) -> torch.Tensor:
    """qkv [T, (q_heads + 2 kv_heads) * head_dim] with its q and k heads RMS-normalised in place (weight [2, D]:
    q's, then k's); returns qkv."""
    t, d = qkv.shape[0], head_dim
    q = qkv[:, : q_heads * d].view(t, q_heads, d)
    k = qkv[:, q_heads * d: (q_heads + kv_heads) * d].view(t, kv_heads, d)
    q.copy_(rms_norm(q, weight[0], eps))
    k.copy_(rms_norm(k, weight[1], eps))
    return qkv


def qk_rms_norm(qkv: torch.Tensor, weight: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int,
                eps: float) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of q and k before RoPE, in place on the fused projection (one kernel on CUDA)."""
    kernel = layer_kernel(qkv, "head_rms_norm")
    if kernel is not None and qkv.dim() == 2 and qkv.stride(-1) == 1:
        return kernel.qk_rms_norm_triton(qkv, weight, q_heads, kv_heads, head_dim, eps)
    return qk_rms_norm_reference(qkv, weight, q_heads, kv_heads, head_dim, eps)
