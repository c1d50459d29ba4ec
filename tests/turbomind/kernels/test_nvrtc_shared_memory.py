"""nvrtc's dynamic shared memory and occupancy bookkeeping against a recording stand-in for the CUDA driver (no GPU
here): a function is opted in to more dynamic shared memory exactly when its static part and the launch's dynamic
part pass the default 48 KiB together, once; occupancy is asked of the driver after that opt-in, once per shape."""

from __future__ import annotations

import ctypes

import pytest

from lmd.turbomind.kernels import nvrtc


class FakeDriver:
    """The driver calls nvrtc makes here, recorded; occupancy answers 2 CTAs an SM."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def cuFuncSetAttribute(self, function, attribute, value) -> int:  # noqa: N802 (the driver's name)
        self.calls.append(("set", attribute, value))
        return 0

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, blocks, function, threads, shared) -> int:  # noqa: N802
        self.calls.append(("occupancy", threads, shared.value))
        ctypes.cast(blocks, ctypes.POINTER(ctypes.c_int)).contents.value = 2
        return 0


@pytest.fixture
def driver(monkeypatch) -> FakeDriver:
    fake = FakeDriver()
    monkeypatch.setattr(nvrtc, "_libcuda", lambda: fake)
    monkeypatch.setattr(nvrtc, "_make_context_current", lambda device: None)
    monkeypatch.setattr(nvrtc.torch.cuda, "current_device", lambda: 0)
    return fake


def test_opt_in_counts_the_static_part(driver) -> None:
    kernel = nvrtc.Kernel(ctypes.c_void_p(1), ctypes.c_void_p(2), static_shared=128)
    nvrtc._allow_shared(kernel, 48 * 1024 - 128)  # together exactly 48 KiB: no opt-in
    assert driver.calls == []
    nvrtc._allow_shared(kernel, 48 * 1024)  # 128 bytes over
    assert driver.calls == [("set", nvrtc.MAX_DYNAMIC_SHARED_SIZE_BYTES, 48 * 1024)]
    nvrtc._allow_shared(kernel, 40 * 1024)  # within what is allowed now
    nvrtc._allow_shared(kernel, 48 * 1024)
    assert len(driver.calls) == 1


def test_occupancy_is_asked_after_the_opt_in_and_cached(driver) -> None:
    kernel = nvrtc.Kernel(ctypes.c_void_p(1), ctypes.c_void_p(2), static_shared=2048)
    assert nvrtc.max_active_blocks(kernel, 384, 89088) == 2
    assert driver.calls == [("set", nvrtc.MAX_DYNAMIC_SHARED_SIZE_BYTES, 89088), ("occupancy", 384, 89088)]
    assert nvrtc.max_active_blocks(kernel, 384, 89088) == 2 and len(driver.calls) == 2
    nvrtc.max_active_blocks(kernel, 384, 1024)
    assert driver.calls[-1] == ("occupancy", 384, 1024) and len(driver.calls) == 3
