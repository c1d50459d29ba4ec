"""Checking run-time CUDA kernels for sm_90 without a GPU, as CI does: they compile with lmd's own NVRTC path
(`lmd.turbomind.kernels.nvrtc.compile_cubin`, NVRTC from the lock's `nvidia-cuda-nvrtc` wheel), and the cuobjdump
that Triton's wheel carries reads the resources and the SASS."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from lmd.turbomind.kernels import nvrtc


class OfflineCompilerMissing(RuntimeError):
    pass


def check_tools() -> None:
    try:
        nvrtc.nvrtc_library()
    except nvrtc.NvrtcUnavailable as e:
        raise OfflineCompilerMissing(str(e)) from e
    cuobjdump()


def cuobjdump() -> str:
    try:
        import triton
    except ImportError as e:
        raise OfflineCompilerMissing("Triton (which carries cuobjdump) is not installed") from e
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        raise OfflineCompilerMissing(f"no cuobjdump at {tool}")
    return str(tool)


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
