"""Fixtures of the interpreter suites and of the offline CUDA compile checks."""

from __future__ import annotations

import pytest

from tests.turbomind.kernels import nvrtc_offline
from tests.turbomind.kernels.interpreter import run_interpreted


@pytest.fixture(scope="module")
def interpreted(request, tiny_llama_ws) -> dict:
    """The requesting test module run as a script under Triton's CPU interpreter, given the tiny Llama workspace
    (reference attention unless the script switches it): its JSON results. A module may define its own."""
    pytest.importorskip("triton")
    return run_interpreted(request.module.__file__, str(tiny_llama_ws[1]), LMD_ATTENTION="reference")


@pytest.fixture(scope="module")
def offline() -> None:
    """NVRTC and cuobjdump for sm_90 builds without a GPU (`nvrtc_offline`), or the test skips."""
    try:
        nvrtc_offline.check_tools()
    except nvrtc_offline.OfflineCompilerMissing as e:
        pytest.skip(str(e))
