"""The one W8A8 dispatch point: per-token activation quantization, then the scaled 8-bit GEMM.

LMD_W8A8_OPS (kernel_choice's auto / reference / triton): auto runs the Triton kernels (w8a8_quant, w8a8_gemm) on
CUDA and the PyTorch reference (w8a8_reference) elsewhere; triton also runs them on CPU under TRITON_INTERPRET=1
(tests). LMD_W8A8_GEMM=torch swaps the GEMM on CUDA for PyTorch's: `torch._scaled_mm` (cuBLASLt FP8, row-wise scales)
or `torch._int_mm` (cuBLAS int8, then the scales applied by a second elementwise pass), for comparison; it needs M > 16
(else the Triton GEMM runs).
"""

from __future__ import annotations

import os

import torch

from lmd.errors import LmdError
from lmd.turbomind.kernel_choice import triton_module, triton_requested
from lmd.turbomind.kernels.w8a8_reference import quantize_per_token_reference, scaled_mm_reference

OPS_ENV = "LMD_W8A8_OPS"
GEMM_ENV = "LMD_W8A8_GEMM"


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (activation dtype) -> y [..., N]; weight int8 / float8_e4m3fn [N, K], weight_scale fp32 [N]."""
    flat = x.reshape(-1, x.shape[-1])
    quant, gemm = _kernels(x)
    if quant is None or gemm is None:
        q, scale = quantize_per_token_reference(flat, weight.dtype)
        y = scaled_mm_reference(q, scale, weight, weight_scale, bias, x.dtype)
    else:
        q, scale = quant.quantize_per_token_triton(flat.contiguous(), weight.dtype)
        y = _torch_gemm(q, scale, weight, weight_scale, bias, x.dtype) if _use_torch_gemm(x, q) else None
        if y is None:
            y = gemm.scaled_mm_triton(q, scale, weight, weight_scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _kernels(x: torch.Tensor) -> tuple[object | None, object | None]:
    if not triton_requested(x, OPS_ENV) or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return None, None
    return triton_module("w8a8_quant"), triton_module("w8a8_gemm")


def _use_torch_gemm(x: torch.Tensor, q: torch.Tensor) -> bool:
    choice = os.environ.get(GEMM_ENV) or "triton"
    if choice not in ("triton", "torch"):
        raise LmdError(f"{GEMM_ENV}={choice!r}: use 'triton' (the default) or 'torch'")
    return choice == "torch" and x.is_cuda and q.shape[0] > 16


def _torch_gemm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    if q.dtype == torch.int8:
        acc = torch._int_mm(q, weight.t())
        y = acc.float() * scale[:, None] * weight_scale[None, :]
        return (y if bias is None else y + bias.float()).to(out_dtype)
    return torch._scaled_mm(q, weight.t(), scale_a=scale[:, None], scale_b=weight_scale[None, :], bias=bias,
                            out_dtype=out_dtype)
