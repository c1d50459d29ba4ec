"""The int4 layout (pack/unpack, AutoAWQ conversion) and the CPU path of the W4A16 dispatch point."""

from __future__ import annotations

import pytest
import torch

from lmd.turbomind.kernels.w4a16 import default_plan, m_bucket, output_is_wrong, w4a16_linear
from lmd.turbomind.kernels.w4a16_layout import (
    AWQ_ORDER,
    awq_to_engine,
    dequantize,
    engine_to_awq,
    pack_awq_int32,
    pack_codes_along_k,
    quantize_to_engine,
    unpack_awq_int32,
    unpack_codes_along_k,
    w4a16_matmul_reference,
)


def _awq_pack_by_hand(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ gemm packing written out: nibble i of int32 j holds column 8j + AWQ_ORDER[i]."""
    rows, cols = codes.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for j in range(cols // 8):
        for i, col in enumerate(AWQ_ORDER):
            out[:, j] |= codes[:, 8 * j + col].to(torch.int64) << (4 * i)
    return ((out + 2**31) % 2**32 - 2**31).to(torch.int32)  # reinterpret as signed int32


def test_pack_along_k_round_trip() -> None:
    codes = torch.randint(0, 16, (96, 40), dtype=torch.int32)
    packed = pack_codes_along_k(codes)
    assert packed.shape == (12, 40) and packed.dtype == torch.int32
    assert torch.equal(unpack_codes_along_k(packed), codes)
    assert ((packed >> 4) & 0xF).equal(codes[1::8])  # k = 8r + 1 sits in bits 4..7 of row r


def test_awq_pack_round_trip_and_order() -> None:
    codes = torch.randint(0, 16, (24, 64), dtype=torch.int32)
    packed = pack_awq_int32(codes)
    assert torch.equal(packed, _awq_pack_by_hand(codes))
    assert torch.equal(unpack_awq_int32(packed), codes)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_to_engine_matches_autoawq_dequant(group: int) -> None:
    k, n = 256, 48
    codes = torch.randint(0, 16, (k, n), dtype=torch.int32)
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.int32)
    scales = (torch.rand(k // group, n) * 0.02 + 0.001).to(torch.float16)
    qweight, qzeros = _awq_pack_by_hand(codes), _awq_pack_by_hand(zeros)
    rep = lambda t: t.repeat_interleave(group, dim=0).to(torch.float32)  # noqa: E731
    direct = (codes.to(torch.float32) - rep(zeros)) * rep(scales)  # AutoAWQ: w = (q - z) * s, W.T [K, N]
    qw, s, z = awq_to_engine(qweight, qzeros, scales, group, dtype=torch.float32)
    torch.testing.assert_close(dequantize(qw, s, z), direct, rtol=0, atol=1e-6)


@pytest.mark.parametrize("group", [64, 128])
def test_engine_to_awq_round_trip(group: int) -> None:
    k, n = 256, 48
    qweight = _awq_pack_by_hand(torch.randint(0, 16, (k, n), dtype=torch.int32))
    qzeros = _awq_pack_by_hand(torch.randint(0, 16, (k // group, n), dtype=torch.int32))
    scales = (torch.rand(k // group, n) * 0.02 + 0.001).to(torch.float16)
    back = engine_to_awq(*awq_to_engine(qweight, qzeros, scales, group, dtype=torch.float16))
    assert torch.equal(back[0], qweight) and torch.equal(back[1], qzeros) and torch.equal(back[2], scales)


def test_awq_to_engine_rejects_wrong_group() -> None:
    qweight = _awq_pack_by_hand(torch.randint(0, 16, (256, 16), dtype=torch.int32))
    qzeros = _awq_pack_by_hand(torch.randint(0, 16, (2, 16), dtype=torch.int32))
    with pytest.raises(ValueError, match="group_size"):
        awq_to_engine(qweight, qzeros, torch.ones(2, 16, dtype=torch.float16), 64)


def test_rtn_quantization_error_is_within_half_a_step() -> None:
    w = torch.randn(32, 256)
    qw, s, z = quantize_to_engine(w, 64, torch.float32)
    err = (dequantize(qw, s, z) - w.t()).abs()
    assert (err <= s.repeat_interleave(64, dim=0) * 0.5 + 1e-6).all()


def test_linear_on_cpu_is_the_reference_plus_bias() -> None:
    torch.manual_seed(0)
    qw, s, z = quantize_to_engine(torch.randn(48, 128), 64, torch.float32)
    x = torch.randn(2, 3, 128)
    bias = torch.randn(48)
    y = w4a16_linear(x, qw, s, z, bias)
    assert y.shape == (2, 3, 48)
    want = x.reshape(6, 128) @ dequantize(qw, s, z) + bias
    torch.testing.assert_close(y.reshape(6, 48), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w4a16_linear(x, qw, s, z), w4a16_matmul_reference(x, qw, s, z))


def test_linear_rejects_mismatched_k() -> None:
    qw, s, z = quantize_to_engine(torch.randn(16, 64), 32)
    with pytest.raises(ValueError, match="K=128"):
        w4a16_linear(torch.randn(1, 128), qw, s, z)


def test_buckets_and_default_paths() -> None:
    assert [m_bucket(m) for m in (1, 2, 3, 7, 16, 33, 2048, 100000)] == [1, 2, 4, 8, 16, 64, 2048, 4096]
    cpu = torch.device("cpu")
    names = [default_plan(m_bucket(m), 4096, 4096, 128, cpu).name().split()[0] for m in (1, 4, 16, 64, 256)]
    assert names == ["gemv", "gemv", "gemm", "gemm", "gemm"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tuner_tells_rounding_from_wrong_output(dtype: torch.dtype) -> None:
    qw, s, z = quantize_to_engine(torch.randn(512, 1024) * 0.02, 128, dtype)
    x = torch.randn(4, 1024, dtype=dtype)
    ref = w4a16_matmul_reference(x.float(), qw, s, z)  # fp32 end to end
    rounded = (x.float() @ dequantize(qw, s.float(), z.float()).to(dtype).float()).to(dtype)  # a tensor-core path
    assert not output_is_wrong(rounded, ref)
    one_off = rounded.clone()
    one_off[2, 100] += 0.3 * ref[2].abs().max()  # one element of 2048, as a race between tiles can leave it
    assert output_is_wrong(one_off, ref)
    swapped = rounded.clone()
    swapped[1] = rounded[2]
    assert output_is_wrong(swapped, ref)
    assert output_is_wrong(torch.full_like(rounded, float("nan")), ref)


def test_tune_drops_a_faster_plan_whose_output_is_wrong(monkeypatch) -> None:
    from lmd.turbomind.kernels import w4a16

    qw, s, z = quantize_to_engine(torch.randn(64, 256) * 0.02, 64, torch.float16)
    right, wrong = (w4a16.GemvConfig(64, 2, split, 1, 1, 1) for split in (2, 4))
    times, ran = {right: 2.0, wrong: 1.0}, []

    def run(plan, x, *weights):
        ran.append(plan)
        y = w4a16_matmul_reference(x, *weights)
        return y if plan == right else y.flip(1)

    def timer(x, weights, kind):
        def time_ms(fn) -> float:
            fn(*weights)
            return times[ran[-1]]

        return time_ms

    monkeypatch.setattr(w4a16, "compile_all", lambda *args: None)
    monkeypatch.setattr(w4a16, "run_plan", run)
    monkeypatch.setattr(w4a16, "candidate_timer", timer)
    best, log = w4a16.tune(1, qw, s, z, torch.float16, [wrong, right])
    assert best == right and [name for name, _ in log] == [right.name()]
    best, log = w4a16.tune(1, qw, s, z, torch.float16, [wrong])  # nothing right: the untuned default
    assert best == w4a16.default_plan(1, 64, 256, 64, torch.device("cpu")) and log == []
