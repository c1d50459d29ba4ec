"""Triton per-head RMSNorm of q and k inside the fused QKV projection, in place (Qwen3's q_norm / k_norm).

The PyTorch reference is `lmd.turbomind.layers.qk_rms_norm_reference` (transformers' Qwen3RMSNorm: the norm in fp32,
rounded to the activation dtype, then times the weight). One program per (token, head) of q and k; v is untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.pdl import pdl_options, pdl_prologue


@triton.jit
def _qk_rms_norm_kernel(qkv_ptr, w_ptr, stride_t, Q_HEADS, eps, D: tl.constexpr, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    ptr = qkv_ptr + row * stride_t + head * D + cols
    x = tl.load(ptr, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    y = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + (head >= Q_HEADS).to(tl.int32) * D + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (w * y).to(x.dtype), mask=mask)


def qk_rms_norm_triton(qkv: torch.Tensor, weight: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int,
                       eps: float) -> torch.Tensor:
    """qkv [T, (q_heads + 2 kv_heads) * head_dim] (rows may be strided, columns contiguous): its q and k heads
    normalised in place with weight [2, head_dim] (q's row, then k's); returns qkv."""
    t = qkv.shape[0]
    if t:
        block = triton.next_power_of_2(head_dim)
        _qk_rms_norm_kernel[(t, q_heads + kv_heads)](qkv, weight, qkv.stride(0), q_heads, eps, D=head_dim,
                                                      BLOCK=block, num_warps=1 if block <= 256 else 4,
                                                      **pdl_options(qkv.device))
    return qkv
