"""W8A8 (int8 SmoothQuant, FP8 e4m3) in plain PyTorch: the CPU path and the oracle of the Triton kernels.

A linear y = x @ W.T, W [N, K], is stored as `weight` int8 or float8_e4m3fn [N, K] and `weight_scale` fp32 [N]
(symmetric, per output channel: W ≈ weight * weight_scale[:, None]). Activations are quantized per token at run time:

    int8:  s_x[t] = absmax(x[t]) / 127,  q = clamp(floor(x * (127 / absmax) + 0.5), -127, 127)
    fp8:   s_x[t] = absmax(x[t]) / 448,  q = e4m3(clamp(x * (448 / absmax), -448, 448))   (round to nearest even)

    y[t, n] = (sum_k q[t, k] * weight[n, k]) * s_x[t] * weight_scale[n]  (+ bias[n])

int8 rounds half away from zero by floor(v + 0.5) on |v|, written the same way in the kernel so both give the same
codes; the products are summed exactly (int32 on the GPU; fp32 here, exact while the sum stays below 2**24).
"""

from __future__ import annotations

import torch

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
MIN_ABSMAX = 1e-8  # an all-zero token gets scale 1e-8 / qmax: its codes are 0 and its output is 0


def quantize_per_token_reference(x: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (codes [T, K] in qdtype, scales fp32 [T])."""
    xf = x.float()
    absmax = xf.abs().amax(dim=-1).clamp(min=MIN_ABSMAX)
    qmax = QMAX[qdtype]
    v = xf * (qmax / absmax)[:, None]
    if qdtype == torch.int8:
        q = (torch.floor(v.abs() + 0.5) * torch.sign(v)).clamp(-qmax, qmax).to(torch.int8)
    else:
        q = v.clamp(-qmax, qmax).to(qdtype)
    return q, absmax / qmax


def scaled_mm_reference(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(q [T, K] @ weight [N, K].T) * x_scale[:, None] * weight_scale[None, :] (+ bias) in out_dtype."""
    acc = q.float() @ weight.float().t()
    y = acc * x_scale.float()[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def w8a8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> y [..., N] in x's dtype: per-token quantization, then the scaled GEMM."""
    flat = x.reshape(-1, x.shape[-1])
    q, scale = quantize_per_token_reference(flat, weight.dtype)
    return scaled_mm_reference(q, scale, weight, weight_scale, bias, x.dtype).reshape(*x.shape[:-1], -1)


def quantize_weight_per_channel(weight: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] float -> (weight [N, K] in qdtype, weight_scale fp32 [N]); round to nearest, symmetric."""
    w = weight.float()
    qmax = QMAX[qdtype]
    scale = w.abs().amax(dim=1).clamp(min=MIN_ABSMAX) / qmax
    v = w / scale[:, None]
    q = torch.round(v).clamp(-qmax, qmax).to(torch.int8) if qdtype == torch.int8 else v.clamp(-qmax, qmax).to(qdtype)
    return q, scale
