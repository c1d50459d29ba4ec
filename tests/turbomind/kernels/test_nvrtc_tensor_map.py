"""nvrtc's tensor maps and struct arguments against a recording stand-in for the CUDA driver (no GPU here): the encoding
call gets the tensor's dimensions innermost first, its row pitch in bytes, the box, the 128-byte swizzle and L2
promotion by 256 bytes and zero fill; what a TMA box cannot take is refused before the driver is asked; bytes pass by
value to a launch."""

from __future__ import annotations

import ctypes

import pytest
import torch

from lmd.turbomind.kernels import nvrtc


class FakeDriver:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def cuTensorMapEncodeTiled(self, out, dtype, rank, address, dims, strides, box, element_strides, interleave,  # noqa: N802
                               swizzle, promotion, fill) -> int:
        self.calls.append((dtype, rank, address.value, list(dims), [strides[0]], list(box), list(element_strides),
                           interleave, swizzle, promotion, fill))
        ctypes.memset(out, 0xAB, nvrtc.TENSOR_MAP_BYTES)
        return 0


@pytest.fixture
def driver(monkeypatch) -> FakeDriver:
    fake = FakeDriver()
    monkeypatch.setattr(nvrtc, "_libcuda", lambda: fake)
    return fake


@pytest.mark.parametrize("dtype, code", [(torch.float16, 6), (torch.bfloat16, 9)])
def test_the_encoding_call(driver, dtype, code) -> None:
    x = torch.zeros(100, 4096, dtype=dtype)
    encoded = nvrtc.tensor_map_2d(x, 128, 64)
    assert encoded == b"\xab" * 128
    (got,) = driver.calls
    assert got == (code, 2, x.data_ptr(), [4096, 100], [8192], [64, 128], [1, 1], 0, 3, 3, 0)


def test_a_row_slice_keeps_its_pitch(driver) -> None:
    x = torch.zeros(64, 8192, dtype=torch.float16)[:, :4096]
    nvrtc.tensor_map_2d(x, 64, 64)
    assert driver.calls[0][3:5] == ([4096, 64], [16384])


@pytest.mark.parametrize("tensor, rows, cols", [
    (torch.zeros(8, 64, dtype=torch.float32), 8, 64),  # 256-byte box rows: not the 128-byte swizzle's
    (torch.zeros(8, 64, dtype=torch.float16), 8, 32),  # 64-byte box rows
    (torch.zeros(8, 64, dtype=torch.float16), 257, 64),  # more box rows than TMA takes
    (torch.zeros(64, 8, dtype=torch.float16).t(), 8, 64),  # not row-major
    (torch.zeros(8, 68, dtype=torch.float16), 8, 64),  # rows 136 bytes apart
])
def test_what_a_box_cannot_take_is_refused_before_the_driver(driver, tensor, rows, cols) -> None:
    with pytest.raises(ValueError, match="tensor map"):
        nvrtc.tensor_map_2d(tensor, rows, cols)
    assert not driver.calls


def test_bytes_pass_by_value() -> None:
    params, values = nvrtc._kernel_params([7, b"\x01\x02" * 64])
    struct = ctypes.cast(params[1], ctypes.POINTER(ctypes.c_ubyte * 128)).contents
    assert bytes(struct) == b"\x01\x02" * 64
    assert ctypes.cast(params[0], ctypes.POINTER(ctypes.c_int)).contents.value == 7
    with pytest.raises(TypeError, match="tensors, ints or bytes"):
        nvrtc._kernel_params([1.5])
