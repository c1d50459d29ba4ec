"""Compiling run-time CUDA kernels for sm_90 without a GPU, as CI checks them: NVIDIA's NVRTC from its wheel (the
lock's `nvidia-cuda-nvrtc`) and the cuobjdump that Triton's wheel carries, for the resources and the SASS."""

from __future__ import annotations

import ctypes
import functools
import subprocess
import tempfile
from pathlib import Path


class OfflineCompilerMissing(RuntimeError):
    pass


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    try:
        import nvidia
    except ImportError as e:
        raise OfflineCompilerMissing("the nvidia-cuda-nvrtc wheel is not installed") from e
    libs = sorted(p for root in nvidia.__path__ for p in Path(root).glob("cu*/lib/libnvrtc.so*"))
    if not libs:
        raise OfflineCompilerMissing("no libnvrtc in the nvidia package")
    return ctypes.CDLL(str(libs[0]))


def cuobjdump() -> str:
    try:
        import triton
    except ImportError as e:
        raise OfflineCompilerMissing("Triton (which carries cuobjdump) is not installed") from e
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        raise OfflineCompilerMissing(f"no cuobjdump at {tool}")
    return str(tool)


def compile_cubin(source: str, arch: str = "sm_90") -> bytes:
    """The cubin of `source` for `arch`; a compile error raises RuntimeError with NVRTC's log."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        options = [f"--gpu-architecture={arch}".encode()]
        result = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        if result:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def inspect(cubin: bytes) -> tuple[dict[str, int], str]:
    """(resource usage: REG, STACK, SHARED, LOCAL, ...; the SASS text) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in res.splitlines() if "REG:" in line)
    usage = {key: int(value) for key, value in (item.split(":") for item in line.split() if ":" in item)
             if value.isdigit()}
    return usage, sass
