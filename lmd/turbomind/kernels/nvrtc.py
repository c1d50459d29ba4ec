"""CUDA C++ kernels compiled at run time with NVRTC, the compiler library PyTorch's CUDA builds ship and load.

For kernels Triton cannot express (warp-level `mma.sync` with hand-placed fragments): the source is a string beside
its PyTorch reference, compiled once per process and specialization for the GPU at hand, and launched on the current
stream, so CUDA graphs capture it like any other kernel. No nvcc, no build step, no new dependency; where NVRTC or
its loader is missing (CPU builds of torch, old releases) `available()` is False and callers keep their other paths.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


class NvrtcUnavailable(RuntimeError):
    """This torch build cannot compile CUDA source at run time."""


@functools.cache
def available() -> bool:
    """Whether run-time compilation can work here: a CUDA device and torch's NVRTC helpers."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.cuda import _utils

        return hasattr(_utils, "_nvrtc_compile") and hasattr(_utils, "_cuda_load_module")
    except ImportError:
        return False


@functools.cache
def _build(source: str, name: str, capability: tuple[int, int]) -> Any:
    """The kernel handle, or the exception building it raised (a failure is remembered, not retried per call)."""
    from torch.cuda import _utils

    try:
        result = _utils._nvrtc_compile(kernel_source=source, kernel_name=name,
                                       compute_capability=f"{capability[0]}{capability[1]}")
        binary, lowered = result if isinstance(result, tuple) else (result, name)
        return _utils._cuda_load_module(binary, [lowered or name])[lowered or name]
    except Exception as e:  # noqa: BLE001 (no NVRTC library, no CUDA headers, a compile error: all mean "not here")
        return NvrtcUnavailable(f"NVRTC could not build {name}: {type(e).__name__}: {e}")


def compile_kernel(source: str, name: str, capability: tuple[int, int]) -> Any:
    """The `extern "C"` kernel `name` of `source`, built for compute capability `capability` (cached per process).
    Returns torch's kernel handle (launch it with `launch`); raises NvrtcUnavailable where it cannot be built."""
    if not available():
        raise NvrtcUnavailable("this torch build has no run-time CUDA compiler (NVRTC)")
    kernel = _build(source, name, capability)
    if isinstance(kernel, NvrtcUnavailable):
        raise kernel
    return kernel


def launch(kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int], args: list[Any]) -> None:
    """Launch on the current stream (a CUDA graph capture records it). Tensors pass as pointers, ints as int32."""
    kernel(grid=grid, block=block, args=args, shared_mem=0, stream=torch.cuda.current_stream())
