"""CUDA C++ kernels compiled at run time with NVRTC, for what Triton cannot express (warp-level `mma.sync` with
hand-placed fragments).

The source (a `.cu` file beside its PyTorch reference) is compiled to a cubin for the GPU at hand, once per process
and specialization, loaded into the device's context with the driver API and launched with cuLaunchKernelEx on
torch's current stream, so CUDA graphs capture it like any other kernel, with programmatic dependent launch where
asked. No nvcc and no build step: NVRTC is the library PyTorch's CUDA wheels already ship (`nvidia-cuda-nvrtc`), or a
CUDA toolkit's. Where it or the driver is missing, `available()` is False and callers keep their other paths. CI
compiles with the same `compile_cubin` (the wheel installs on CPU machines too) and checks the SASS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path
from typing import Any

import torch


class NvrtcUnavailable(RuntimeError):
    """No run-time CUDA compiler (or driver) here, or the source did not build."""


def _library_candidates() -> list[str]:
    """libnvrtc from the nvidia wheels first, the one of torch's CUDA major version ahead of others (a newer
    compiler's cubin may not load on the driver torch runs with), then the system's."""
    paths: list[str] = []
    try:
        import nvidia

        for root in nvidia.__path__:
            paths += sorted(str(p) for p in Path(root).glob("*/lib/libnvrtc.so*") if "builtins" not in p.name)
    except ImportError:
        pass
    major = (torch.version.cuda or "").split(".")[0]
    paths.sort(key=lambda path: not (major and Path(path).name.startswith(f"libnvrtc.so.{major}")))
    found = ctypes.util.find_library("nvrtc")
    return [*paths, *([found] if found else []), "libnvrtc.so", "/usr/local/cuda/lib64/libnvrtc.so"]


@functools.cache
def nvrtc_library() -> ctypes.CDLL:
    for path in _library_candidates():
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise NvrtcUnavailable("no NVRTC library (pip install nvidia-cuda-nvrtc, or a CUDA toolkit)")


@functools.cache
def _libcuda() -> ctypes.CDLL:
    """The CUDA driver library, loaded once."""
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def available() -> bool:
    """Whether kernels can be built and launched here: a CUDA device, NVRTC and the driver library."""
    if not torch.cuda.is_available():
        return False
    try:
        nvrtc_library()
        _libcuda()
    except (NvrtcUnavailable, OSError):
        return False
    return True


def compile_cubin(source: str, arch: str) -> bytes:
    """The cubin of `source` for `arch` (e.g. "sm_90"); a compile error raises NvrtcUnavailable with NVRTC's log."""
    lib = nvrtc_library()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None):
        raise NvrtcUnavailable("nvrtcCreateProgram failed")
    try:
        options = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
        if lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options)):
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise NvrtcUnavailable(f"NVRTC: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _check(result: int, what: str) -> None:
    if result:
        message = ctypes.c_char_p()
        _libcuda().cuGetErrorString(result, ctypes.byref(message))
        raise RuntimeError(f"{what}: CUDA error {result} ({(message.value or b'?').decode()})")


DEFAULT_SHARED_LIMIT = 48 * 1024  # static + dynamic shared memory a block may use without opting in
SHARED_SIZE_BYTES = 1  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: the function's static shared memory
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class Kernel:
    """A loaded kernel: the driver's function handle, and its module kept alive with it."""

    def __init__(self, function: ctypes.c_void_p, module: ctypes.c_void_p, static_shared: int = 0) -> None:
        self.function, self.module = function, module
        # dynamic shared memory a launch may ask for without opting in: the default limit covers static + dynamic
        self.shared_allowed = DEFAULT_SHARED_LIMIT - static_shared
        self.resident: dict[tuple[int, int], int] = {}  # (threads, dynamic shared bytes) -> CTAs an SM holds


def _make_context_current(device: int) -> None:
    """The device's primary context (the one torch's runtime uses) current on this thread: a thread that has made
    no CUDA runtime call yet has none, and the driver calls below need one."""
    lib = _libcuda()
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        handle = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle), "cuDevicePrimaryCtxRetain")
        _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def _build(source: str, name: str, device: int, arch_suffix: str) -> Kernel:
    major, minor = torch.cuda.get_device_capability(device)
    cubin = compile_cubin(source, f"sm_{major}{minor}{arch_suffix}")
    with torch.cuda.device(device):
        _make_context_current(device)
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        _check(_libcuda().cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        _check(_libcuda().cuModuleGetFunction(ctypes.byref(function), module, name.encode()), "cuModuleGetFunction")
        static = ctypes.c_int()
        _check(_libcuda().cuFuncGetAttribute(ctypes.byref(static), SHARED_SIZE_BYTES, function), "cuFuncGetAttribute")
    return Kernel(function, module, static.value)


_KERNELS: dict[tuple[str, str, int, str], Kernel | NvrtcUnavailable] = {}  # a failure is remembered, not retried


def compile_kernel(source: str, name: str, device: int, arch_suffix: str = "") -> Kernel:
    """The `extern "C"` kernel `name` of `source`, built for CUDA device `device`'s architecture (+ `arch_suffix`:
    "a" for sm_90a's wgmma and setmaxnreg) and loaded into its context (cached per process); raises
    NvrtcUnavailable where it cannot be built. Build kernels before a CUDA graph capture: loading a module is not
    allowed in one (refused here, and not remembered as a failure)."""
    if not available():
        raise NvrtcUnavailable("no run-time CUDA compiler or driver here")
    key = (source, name, device, arch_suffix)
    if key not in _KERNELS:
        if torch.cuda.is_current_stream_capturing():
            raise NvrtcUnavailable(f"{name} is not built yet and a CUDA graph is being captured: build it first")
        try:
            _KERNELS[key] = _build(source, name, device, arch_suffix)
        except (NvrtcUnavailable, RuntimeError, OSError) as e:
            _KERNELS[key] = e if isinstance(e, NvrtcUnavailable) else NvrtcUnavailable(f"{name}: {e}")
    kernel = _KERNELS[key]
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


def launch_config(grid: tuple[int, int, int], block: tuple[int, int, int], stream: int, pdl: bool,
                  shared_bytes: int = 0) -> tuple[_LaunchConfig, _LaunchAttribute]:
    """cuLaunchKernelEx's config; with `pdl` the launch may start while the previous kernel in the stream finishes
    (the kernel waits with griddepcontrol.wait before it reads that kernel's output). Keep the attribute alive."""
    attr = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    ctypes.memmove(ctypes.addressof(attr) + _LaunchAttribute.value.offset, ctypes.byref(ctypes.c_int(1)), 4)
    config = _LaunchConfig(*grid, *block, shared_bytes, stream, ctypes.pointer(attr), int(pdl))
    return config, attr


def _kernel_params(args: list[Any]) -> tuple[ctypes.Array, list[Any]]:
    """void** kernelParams for tensors (as device pointers), ints (as int32) and bytes (a struct passed by value,
    such as a tensor map), with the values kept alive."""
    values: list[Any] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            values.append(ctypes.c_void_p(arg.data_ptr()))
        elif isinstance(arg, int):
            values.append(ctypes.c_int(arg))
        elif isinstance(arg, bytes):
            values.append(ctypes.create_string_buffer(arg, len(arg)))
        else:
            raise TypeError(f"kernel argument of type {type(arg).__name__}: pass tensors, ints or bytes")
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    return params, values


def _allow_shared(kernel: Kernel, shared_bytes: int) -> None:
    """Opt the function in to `shared_bytes` of dynamic shared memory where the default limit is too small."""
    if shared_bytes > kernel.shared_allowed:
        _check(_libcuda().cuFuncSetAttribute(kernel.function, MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes),
               "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        kernel.shared_allowed = shared_bytes


def max_active_blocks(kernel: Kernel, threads: int, shared_bytes: int) -> int:
    """CTAs of `threads` threads and `shared_bytes` of dynamic shared memory one SM holds at once (the driver's
    occupancy calculator; cached per kernel). On the current device, which must be the kernel's."""
    key = (threads, shared_bytes)
    if key not in kernel.resident:
        _make_context_current(torch.cuda.current_device())
        _allow_shared(kernel, shared_bytes)
        blocks = ctypes.c_int()
        _check(_libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), kernel.function, threads,
                                                                       ctypes.c_size_t(shared_bytes)),
               "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        kernel.resident[key] = blocks.value
    return kernel.resident[key]


def launch(kernel: Kernel, grid: tuple[int, int, int], block: tuple[int, int, int], args: list[Any],
           pdl: bool = False, shared_bytes: int = 0) -> None:
    """Launch on the current stream of the current device, which must be the kernel's (a CUDA graph capture
    records it). Tensors pass as pointers, ints as int32. With `pdl`, programmatic stream serialization (sm_90);
    `shared_bytes` of dynamic shared memory (past 48 KiB with the function's static shared memory, the function is
    opted in once, at its first such launch)."""
    _make_context_current(torch.cuda.current_device())
    _allow_shared(kernel, shared_bytes)
    config, _attr = launch_config(grid, block, torch.cuda.current_stream().cuda_stream, pdl, shared_bytes)
    params, _values = _kernel_params(args)
    _check(_libcuda().cuLaunchKernelEx(ctypes.byref(config), kernel.function, params, None), "cuLaunchKernelEx")


TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap)
_TENSOR_MAP_DTYPES = {torch.float16: 6, torch.bfloat16: 9}  # CUtensorMapDataType
_SWIZZLE_128B, _L2_PROMOTION_256B = 3, 3


def tensor_map_2d(tensor: torch.Tensor, box_rows: int, box_cols: int) -> bytes:
    """The CUtensorMap (cuTensorMapEncodeTiled) of a row-major 2-D CUDA tensor for boxes of box_rows x box_cols
    elements in the 128-byte swizzle (box_cols x the element size must be 128 bytes): a TMA copy lands row r's
    16-byte chunk c at r * 128 + (c ^ (r % 8)) * 16 of a 1024-aligned destination, elements past the tensor's
    edge as zeros."""
    rows, cols = tensor.shape
    size = tensor.element_size()
    if (tensor.dtype not in _TENSOR_MAP_DTYPES or box_cols * size != 128 or not 1 <= box_rows <= 256
            or tensor.stride(1) != 1 or (tensor.stride(0) * size) % 16 or tensor.data_ptr() % 16):
        raise ValueError(f"tensor map: a 16-byte aligned row-major {list(_TENSOR_MAP_DTYPES)} tensor with rows a "
                         f"multiple of 16 bytes apart, boxes of 1-256 rows x 128 bytes; got {tensor.dtype} "
                         f"{tuple(tensor.shape)} strides {tensor.stride()}, box {box_rows} x {box_cols}")
    encoded = (ctypes.c_ubyte * TENSOR_MAP_BYTES)()
    u64x2, u32x2 = ctypes.c_uint64 * 2, ctypes.c_uint32 * 2
    _check(_libcuda().cuTensorMapEncodeTiled(
        ctypes.byref(encoded), _TENSOR_MAP_DTYPES[tensor.dtype], 2, ctypes.c_void_p(tensor.data_ptr()),
        u64x2(cols, rows), u64x2(tensor.stride(0) * size, 0), u32x2(box_cols, box_rows), u32x2(1, 1),
        0, _SWIZZLE_128B, _L2_PROMOTION_256B, 0), "cuTensorMapEncodeTiled")
    return bytes(encoded)
