"""CUDA C++ kernels compiled at run time with NVRTC, the compiler library PyTorch's CUDA builds ship and load.

For kernels Triton cannot express (warp-level `mma.sync` with hand-placed fragments): the source is a string beside
its PyTorch reference, compiled once per process and specialization for the GPU at hand, and launched on the current
stream, so CUDA graphs capture it like any other kernel. No nvcc, no build step, no new dependency; where NVRTC or
its loader is missing (CPU builds of torch, old releases) `available()` is False and callers keep their other paths.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch


class NvrtcUnavailable(RuntimeError):
    """This torch build cannot compile CUDA source at run time."""


@functools.cache
def available() -> bool:
    """Whether run-time compilation can work here: a CUDA device, torch's NVRTC helpers and the driver library."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.cuda import _utils
    except ImportError:
        return False
    if not (hasattr(_utils, "_nvrtc_compile") and hasattr(_utils, "_cuda_load_module")):
        return False
    try:
        _libcuda()
    except OSError:
        return False
    return True


@functools.cache
def _libcuda() -> ctypes.CDLL:
    """The CUDA driver library (cuLaunchKernelEx), loaded once."""
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def _build(source: str, name: str, capability: tuple[int, int], device: int) -> Any:
    """The kernel handle, or the exception building it raised (a failure is remembered, not retried per call).
    Called with `device` current: the module loads into that device's context."""
    from torch.cuda import _utils

    try:
        result = _utils._nvrtc_compile(kernel_source=source, kernel_name=name,
                                       compute_capability=f"{capability[0]}{capability[1]}")
        binary, lowered = result if isinstance(result, tuple) else (result, name)
        return _utils._cuda_load_module(binary, [lowered or name])[lowered or name]
    except Exception as e:  # noqa: BLE001 (no NVRTC library, no CUDA headers, a compile error: all mean "not here")
        return NvrtcUnavailable(f"NVRTC could not build {name}: {type(e).__name__}: {e}")


def compile_kernel(source: str, name: str, capability: tuple[int, int], device: int = 0) -> Any:
    """The `extern "C"` kernel `name` of `source`, built for compute capability `capability` and loaded on CUDA
    device `device` (cached per process). Returns torch's kernel handle (launch it with `launch` while that device is
    current); raises NvrtcUnavailable where it cannot be built."""
    if not available():
        raise NvrtcUnavailable("this torch build has no run-time CUDA compiler (NVRTC)")
    with torch.cuda.device(device):
        kernel = _build(source, name, capability, device)
    if isinstance(kernel, NvrtcUnavailable):
        raise kernel
    return kernel


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute (cuda.h): an enum id, padding to 8, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig (cuda.h)
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def pdl_launch_config(grid: tuple[int, int, int], block: tuple[int, int, int], stream: int
                      ) -> tuple[_LaunchConfig, _LaunchAttribute]:
    """cuLaunchKernelEx's config for a launch that may start while the previous kernel in the stream finishes (the
    kernel waits with griddepcontrol.wait before it reads that kernel's output). Keep the attribute alive with it."""
    attr = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    ctypes.memmove(ctypes.addressof(attr) + _LaunchAttribute.value.offset, ctypes.byref(ctypes.c_int(1)), 4)
    config = _LaunchConfig(*grid, *block, 0, stream, ctypes.pointer(attr), 1)
    return config, attr


def _kernel_params(args: list[Any]) -> tuple[ctypes.Array, list[Any]]:
    """void** kernelParams for tensors (as device pointers) and ints (as int32), with the values kept alive."""
    values: list[Any] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            values.append(ctypes.c_void_p(arg.data_ptr()))
        elif isinstance(arg, int):
            values.append(ctypes.c_int(arg))
        else:
            raise TypeError(f"kernel argument of type {type(arg).__name__}: pass tensors or ints")
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    return params, values


def launch(kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int], args: list[Any],
           pdl: bool = False) -> None:
    """Launch on the current stream of the current device (a CUDA graph capture records it; the caller makes the
    kernel's device current). Tensors pass as pointers, ints as int32. With `pdl`, through cuLaunchKernelEx with
    programmatic stream serialization (sm_90)."""
    stream = torch.cuda.current_stream()
    if not pdl:
        kernel(grid=grid, block=block, args=args, shared_mem=0, stream=stream)
        return
    config, _attr = pdl_launch_config(grid, block, stream.cuda_stream)
    params, _values = _kernel_params(args)
    result = _libcuda().cuLaunchKernelEx(ctypes.byref(config), kernel.func, params, None)
    if result:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {result}")
