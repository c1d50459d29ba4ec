"""Linear layers of the engine: dense (fp32/fp16/bf16, [out, in] weights), int4 W4A16 (engine layout) and W8A8
(int8 or FP8 weights with per-channel scales, activations quantized per token at run time).

`int4_matmul` is the one place the int4 path is chosen: the kernels module's `w4a16_linear` dispatches to Triton on
CUDA and to the PyTorch reference elsewhere. `w8a8_linear` is the W8A8 one: per-token activation quantization, then
the scaled 8-bit GEMM. LMD_W8A8_OPS (kernel_choice's auto / reference / triton): auto runs the Triton kernels
(kernels/w8a8_quant.py, w8a8_gemm.py) on CUDA and the PyTorch reference (kernels/w8a8_reference.py) elsewhere; triton
also runs them on CPU under TRITON_INTERPRET=1 (tests). On CUDA each W8A8 weight plans its GEMM per row bucket at load
(kernels/w8a8_plan.py: lmd's Triton tiles or PyTorch's `torch._scaled_mm` / `torch._int_mm`, whichever is fastest
on this GPU); LMD_W8A8_GEMM=triton or torch forces one side.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lmd.turbomind.kernel_choice import triton_module, triton_requested
from lmd.turbomind.kernels.w8a8_reference import quantize_per_token_reference, scaled_mm_reference

W8A8_OPS_ENV = "LMD_W8A8_OPS"


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    return _int4_impl()(x, qweight, scales, zeros, bias)


@functools.cache
def _int4_impl() -> Callable[..., torch.Tensor]:
    try:
        from lmd.turbomind.kernels.w4a16 import w4a16_linear
    except ImportError:  # the kernels module is optional; the layout module's reference is always there
        return _int4_reference
    return w4a16_linear


def _int4_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    from lmd.turbomind.kernels.w4a16_layout import w4a16_matmul_reference

    y = w4a16_matmul_reference(x, qweight, scales, zeros)
    return y if bias is None else y + bias


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, plans: dict | None = None) -> torch.Tensor:
    """x [..., K] (activation dtype) -> y [..., N]; weight int8 / float8_e4m3fn [N, K], weight_scale fp32 [N];
    plans: `w8a8_plan.plans_for`'s GEMM per row bucket."""
    flat = x.reshape(-1, x.shape[-1])
    quant, plan = _w8a8_kernels(x)
    if quant is None or plan is None:
        q, scale = quantize_per_token_reference(flat, weight.dtype)
        y = scaled_mm_reference(q, scale, weight, weight_scale, bias, x.dtype)
    else:
        q, scale = quant.quantize_per_token_triton(flat.contiguous(), weight.dtype)
        y = plan.gemm(q, scale, weight, weight_scale, bias, x.dtype, plans or {})
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _w8a8_kernels(x: torch.Tensor) -> tuple[object | None, object | None]:
    if not triton_requested(x, W8A8_OPS_ENV) or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return None, None
    return triton_module("w8a8_quant"), triton_module("w8a8_plan")


CPU_SWAP_ROWS = range(2, 4)  # token rows for which `cpu_linear` computes (W @ x.T).T


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for fp32 on CPU, with 2-5 token rows (speculative verifications, small batches) computed as
    (W @ x.T).T: MKL runs F.linear of so few rows as one weight-streaming GEMV per row, so weights that are not in
    cache are read 2-5 times, while the swapped product is one GEMM that reads them once (SmolLM2's 30 layers, one
    thread, cold weights: 64 / 72 / 48 ms for 2 / 3 / 4 rows against 24 / 37 / 36; one row 37 either way)."""
    if (x.dim() == 2 and x.shape[0] in CPU_SWAP_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32):
        y = (weight @ x.T).T.contiguous()  # row-major like F.linear's: callers split heads out of it as views
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class DenseLinear:
    """A decode batch of up to 64 token rows runs a skinny GEMM where it beats cuBLAS on this GPU (`plans_for`: the
    one-row GEMV, the tensor-core kernel for 2-64 rows in four buckets; timed once per weight shape at load);
    everything else is F.linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]
        self.plans = _plans(weight) if weight.is_cuda else {}

    def replan(self) -> None:
        """The weight tensor was replaced (weight offload's device slot): choose the kernels for it."""
        self.plans = _plans(self.weight) if self.weight.is_cuda else {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.plans and x.dim() == 2 and x.stride(1) == 1:
            from lmd.turbomind.kernels.dense_gemv_plan import bucket_of, run_planned

            config = self.plans.get(bucket_of(x.shape[0]))  # type: ignore[arg-type]
            if config is not None:
                return run_planned(x, self.weight, self.bias, config)
        return cpu_linear(x, self.weight, self.bias)


def _plans(weight: torch.Tensor) -> dict:
    try:
        from lmd.turbomind.kernels.dense_gemv_plan import plans_for
    except ImportError:  # no Triton: cuBLAS
        return {}
    return plans_for(weight)


class Int4Linear:
    """`perm` (act-order checkpoints, docs/workspace.md): the weight's input channels are stored sorted by
    quantization group, so the activation's channels are gathered into the same order first."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None, perm: torch.Tensor | None = None) -> None:
        self.qweight, self.scales, self.zeros, self.bias = qweight, scales, zeros, bias
        self.perm = None if perm is None else perm.to(device=qweight.device, dtype=torch.long)
        self.out_features = qweight.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return int4_matmul(x, self.qweight, self.scales, self.zeros, self.bias)


class W8A8Linear:
    """On CUDA the GEMM of each row bucket is planned at load (`w8a8_plan`), so none is timed inside a forward or a
    graph capture."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.weight, self.weight_scale, self.bias = weight, weight_scale.float(), bias
        self.out_features = weight.shape[0]
        self.dtype = dtype
        self.replan()

    def replan(self) -> None:
        """The weight tensor was replaced (weight offload's device slot): choose the GEMMs for it."""
        self.plans = {}
        if self.weight.is_cuda and self.dtype is not None and triton_requested(self.weight, W8A8_OPS_ENV):
            with contextlib.suppress(ImportError):  # no Triton: the reference path, nothing to plan
                from lmd.turbomind.kernels.w8a8_plan import plans_for

                self.plans = plans_for(self.weight, self.weight_scale, self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return w8a8_linear(x, self.weight, self.weight_scale, self.bias, self.plans)


Linear = DenseLinear | Int4Linear | W8A8Linear


def make_linear(weights: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> Linear:
    """`name`.weight (dense), `name`.qweight/.scales/.zeros[/.perm] (int4) or `name`.weight/.weight_scale (W8A8),
    with an optional `name`.bias."""
    bias = weights.get(f"{name}.bias")
    bias = None if bias is None else bias.to(dtype)
    if f"{name}.qweight" in weights:
        return Int4Linear(weights[f"{name}.qweight"], weights[f"{name}.scales"].to(dtype),
                          weights[f"{name}.zeros"].to(dtype), bias, weights.get(f"{name}.perm"))
    if f"{name}.weight_scale" in weights:
        return W8A8Linear(weights[f"{name}.weight"], weights[f"{name}.weight_scale"], bias, dtype)
    return DenseLinear(weights[f"{name}.weight"].to(dtype), bias)
