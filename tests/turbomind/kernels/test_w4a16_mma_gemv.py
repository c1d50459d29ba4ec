"""The CUDA mma.sync W4A16 kernel without a GPU: its PyTorch twin and a lane-level emulation of its source against
the engine's reference, the host wrapper's errors, and the tuner's opt-in."""

from __future__ import annotations

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.kernels import nvrtc
from lmd.turbomind.kernels import w4a16_mma_gemv as kernel
from lmd.turbomind.kernels.w4a16_layout import unpack_codes_along_k, w4a16_matmul_reference
from lmd.turbomind.kernels.w4a16_mma_gemv import MmaGemvConfig, mma_gemv, mma_gemv_reference, unit_values
from tests.turbomind.kernels import mma_gemv_lanes
from tests.turbomind.kernels.mma_cases import DTYPES, ROW_LIMIT, engine_weights, lane_case, row_errors


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("word", [True, False])
def test_decode_bits_read_as_code_over_scale_plus_offset(dtype, word) -> None:
    qweight, _, _ = engine_weights(64, 256, 64, dtype)
    values, offsets = unit_values(qweight, dtype, word and dtype == torch.float16)
    codes = unpack_codes_along_k(qweight).reshape(32, 8, 64).permute(0, 2, 1).float()  # [K/8, N, nibble]
    scale = 64.0 if word and dtype == torch.float16 else 16.0
    assert torch.equal(values, offsets + codes / scale)  # exact: every decoded value is representable


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", kernel.GROUPS)
@pytest.mark.parametrize("word", [True, False])
def test_twin_matches_the_engine_reference(dtype, group, word) -> None:
    qweight, scales, zeros = engine_weights(128, 512, group, dtype)
    x = torch.randn(11, 512, dtype=dtype, generator=torch.Generator().manual_seed(1)) * 3
    ref = w4a16_matmul_reference(x.float(), qweight, scales, zeros).float()
    y = mma_gemv_reference(x, qweight, scales, zeros, MmaGemvConfig(16, word_decode=word))
    # the fold's cancellation costs a few of fp32's 24 bits: far below one rounding of the output
    assert row_errors(y, ref).max() < ROW_LIMIT[dtype] / 5


CASES = [  # (n, k, group, m, config): unsplit and split-K launches, both token blocks, 1-8 warps, both decodes
    (128, 512, 128, 1, MmaGemvConfig(8, 2, 1)),
    (128, 512, 128, 5, MmaGemvConfig(8, 4, 2, True, False)),
    (64, 256, 32, 8, MmaGemvConfig(8, 8, 1)),
    (128, 384, 64, 11, MmaGemvConfig(16, 2, 1)),
    (64, 512, 128, 16, MmaGemvConfig(16, 4, 64)),
    (192, 640, 128, 3, MmaGemvConfig(8, 2, 2, True)),  # 5 groups over CTAs of 4: a short last CTA
    (64, 512, 128, 20, MmaGemvConfig(32, 2, 1)),  # dequantized in registers, shared-memory atomics
    (128, 384, 64, 32, MmaGemvConfig(32, 4, 1, True, False)),
    (64, 256, 32, 70, MmaGemvConfig(32, 2, 2, True)),  # three token tiles, the last of 6 rows
    (64, 256, 128, 40, MmaGemvConfig(16, 2, 1)),  # three token tiles of the folding kernel
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}k{c[1]}g{c[2]}m{c[3]}-{c[4].name().replace(' ', '_')}")
def test_lane_emulation_of_the_kernel_matches_the_reference(dtype, case) -> None:
    n, k, group, m, cfg = case
    qweight, scales, zeros, x, bias, ref = lane_case(n, k, group, m, dtype)
    y = mma_gemv_lanes.run(x, qweight, scales, zeros, bias, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    assert row_errors(y, ref).max() < ROW_LIMIT[dtype]
    twin = mma_gemv_reference(x, qweight, scales, zeros, cfg).float() + bias.float()
    assert row_errors(y, twin).max() < ROW_LIMIT[dtype]


def test_the_emulation_catches_a_wrong_fragment_plan(monkeypatch) -> None:
    """Swapping the two PRMT selectors (x paired with the wrong nibbles) must fail the check above."""
    qweight, scales, zeros = engine_weights(64, 256, 128, torch.float16)
    x = torch.randn(2, 256, dtype=torch.float16, generator=torch.Generator().manual_seed(3))
    ref = w4a16_matmul_reference(x.float(), qweight, scales, zeros).float()
    prmt = mma_gemv_lanes.prmt
    monkeypatch.setattr(mma_gemv_lanes, "prmt", lambda a, b, sel: prmt(a, b, sel ^ 0x7632 ^ 0x5410))
    y = mma_gemv_lanes.run(x, qweight, scales, zeros, None, MmaGemvConfig(8, 2, 1))
    assert row_errors(y, ref).max() > 0.1


def test_the_emulation_reads_the_constants_the_source_uses() -> None:
    for text in ("0x5410", "0x7632", "0x000F000Fu", "0x00F000F0u", "0x4C004C00u", "0x3C003C00u", "0x3F803F80u",
                 "0x00780078u", "0x03C003C0u", "m16n8k16.row.col.f32", "q >> 8", "offset_a, one, one, one",
                 "cs * (d[b][j][2 * r] - xs[b][0]);", "zr * xs[b][2];"):
        assert text in kernel.FRAGMENT + kernel.SOURCE, text


def test_kernel_source_specializes_by_dtype_and_config() -> None:
    fp16 = kernel.kernel_source(torch.float16, 128, MmaGemvConfig(16, 8, 2, True))
    bf16 = kernel.kernel_source(torch.bfloat16, 64, MmaGemvConfig(8, 2, 1))
    assert "#define MB 2\n" in fp16 and "#define GSTEPS 4\n" in fp16 and "#define WORD_DECODE 1\n" in fp16
    assert "#define BF16 1\n" in bf16 and "#define GSTEPS 2\n" in bf16 and "#define WORD_DECODE 0\n" in bf16


def test_wrapper_rejects_what_the_kernel_cannot_take() -> None:
    qweight, scales, zeros = engine_weights(96, 256, 128, torch.float16)  # N = 96: not whole 64-channel blocks
    with pytest.raises(ValueError, match="N % 64"):
        mma_gemv(torch.randn(1, 256, dtype=torch.float16), qweight, scales, zeros, None, MmaGemvConfig())
    qweight, scales, zeros = engine_weights(64, 256, 128, torch.float16)
    with pytest.raises(ValueError, match="CUDA tensors"):
        mma_gemv(torch.randn(1, 256, dtype=torch.float16), qweight, scales, zeros, None, MmaGemvConfig())
    with pytest.raises(ValueError, match="fp16/bf16 x"):
        mma_gemv(torch.randn(1, 256, dtype=torch.bfloat16), qweight, scales, zeros, None, MmaGemvConfig())
    with pytest.raises(ValueError, match="block_m one of"):
        MmaGemvConfig(24)
    with pytest.raises(ValueError, match="groups_per_warp >= 1"):
        MmaGemvConfig(8, 4, 0)
    with pytest.raises(ValueError, match="stages one of"):
        MmaGemvConfig(8, 4, 4, stages=5)
    with pytest.raises(ValueError, match="not with prefetch"):
        MmaGemvConfig(8, 4, 4, True, stages=2)
    assert not kernel.supports(128, 256, 256) and kernel.supports(128, 256, 64)


def test_cpu_machines_neither_compile_nor_offer_it(monkeypatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    for setting in ("", "1"):
        monkeypatch.setenv("LMD_W4A16_CUDA", setting)
        assert kernel.cuda_kernels(torch.device("cpu")) == "none"
    assert not nvrtc.available()
    with pytest.raises(nvrtc.NvrtcUnavailable):
        nvrtc.compile_kernel(kernel.SOURCE, "w4a16_mma_gemv", 0)


def test_tuner_configs_cover_buckets_up_to_128() -> None:
    assert kernel.tuner_configs(256, 4096, 4096, 128) == []
    assert kernel.tuner_configs(4, 4096, 4096, 256) == []
    blocks = {bucket: {c.block_m for c in kernel.tuner_configs(bucket, 4096, 4096, 128)} for bucket in (4, 16, 32, 128)}
    assert blocks == {4: {8}, 16: {16}, 32: {32}, 128: {32}}
    configs = kernel.tuner_configs(16, 4096, 4096, 128)
    assert len({c.name() for c in configs}) == len(configs) > 10
    staged = [c for c in kernel.tuner_configs(16, 4096, 4096, 128, staged=True) if c not in configs]
    assert staged and all(2 <= c.stages <= c.groups_per_warp and not c.prefetch for c in staged)
    assert len({c.name() for c in configs + staged}) == len(configs) + len(staged) and not any(c.stages for c in configs)


def test_staged_configs_size_their_shared_memory() -> None:
    """A stage is a group's words (two 16-byte slots a k32 step, 32 lanes each) and 4 x 32 lanes x 8 bytes of scales
    and zeros, a warp holds `stages` of them; the define reaches the source."""
    assert MmaGemvConfig(8, 4, 8, stages=4).shared_bytes(128) == 4 * 4 * (4 * 1024 + 1024)
    assert MmaGemvConfig(16, 8, 2, stages=2).shared_bytes(32) == 8 * 2 * (1024 + 1024)
    assert MmaGemvConfig(8, 4, 2, True).shared_bytes(128) == 0
    source = kernel.kernel_source(torch.float16, 128, MmaGemvConfig(8, 8, 4, stages=3))
    assert "#define STAGES 3\n" in source and "#define PREFETCH 0\n" in source
    assert "#define STAGE_BYTES 5120\n" in source  # what shared_bytes counts a stage (4 k32 steps at g128)


def staged_schedule(groups: int, stages: int, pending: int | None = None) -> list[int]:
    """The staged loop of w4a16_mma_gemv.cu for one warp with `groups` groups, as a protocol model: which group each
    iteration reads, asserting that the stage it reads holds that group and that cp.async.wait_group(pending, the
    kernel's STAGES - 1) has completed its copy (all but the newest `pending` commit groups; nothing more assumed)."""
    pending = stages - 1 if pending is None else pending
    slots: list[tuple[int, int] | None] = [None] * stages  # (group, commit group of its copy)
    commits = 0
    for j in range(stages):  # prologue: the first STAGES groups, one commit group each (empty past the last)
        if j < groups:
            slots[j] = (j, commits)
        commits += 1
    read = []
    for j in range(groups):
        complete = commits - pending  # wait_stages<STAGES - 1>: commit groups [0, complete) have landed
        held = slots[j % stages]
        assert held is not None and held[0] == j and held[1] < complete, (groups, stages, j, held)
        read.append(held[0])
        if j + stages < groups:  # the refill of the stage just read: group j + STAGES
            slots[j % stages] = (j + stages, commits)
        commits += 1
    return read


def test_the_staged_loop_reads_every_group_once_after_its_copy_landed() -> None:
    for text in ("wait_stages<STAGES - 1>();", "const u32 stage = warp_stages + (j % STAGES) * STAGE_BYTES;",
                 "if (gi + STAGES * WARPS < end) copy_weights(stage,", "for (int j = 0; j < STAGES; ++j) {",
                 "if (gi < end) copy_weights(warp_stages + j * STAGE_BYTES,"):
        assert text in kernel.SOURCE, text
    for stages in kernel.STAGES[1:]:
        for groups in range(12):
            assert staged_schedule(groups, stages) == list(range(groups))
    with pytest.raises(AssertionError):  # a wait that leaves STAGES copies pending reads one still in flight
        staged_schedule(5, 3, pending=3)


def test_the_setting_picks_the_cuda_kernels(monkeypatch) -> None:
    """Unset: the GEMV; 1: all three; 0: none; anything else is an error naming the choices (on an sm_90 device with
    NVRTC, here stood in for); before sm_80 (no m16n8k16 MMA, no cp.async) none."""
    monkeypatch.setattr(nvrtc, "available", lambda: True)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("LMD_W4A16_CUDA", raising=False)
    assert kernel.cuda_kernels(cuda) == "default"
    for setting, want in (("", "default"), ("1", "all"), ("0", "none")):
        monkeypatch.setenv("LMD_W4A16_CUDA", setting)
        assert kernel.cuda_kernels(cuda) == want
    capability[0] = (7, 5)
    assert kernel.cuda_kernels(cuda) == "none"
    monkeypatch.setenv("LMD_W4A16_CUDA", "1")
    assert kernel.cuda_kernels(cuda) == "none"
    monkeypatch.setenv("LMD_W4A16_CUDA", "yes")
    with pytest.raises(LmdError, match="0 .*1 .*unset"):
        kernel.cuda_kernels(cuda)


def test_the_dispatcher_offers_it_up_to_16_rows_by_default_and_to_128_with_all(monkeypatch) -> None:
    pytest.importorskip("triton")
    from lmd.turbomind.kernels import w4a16

    cpu = torch.device("cpu")

    def offered(bucket: int) -> list:
        return [p for p in w4a16.candidates(bucket, 4096, 4096, 128, cpu) if isinstance(p, MmaGemvConfig)]

    assert not offered(8)
    monkeypatch.setattr(kernel, "cuda_kernels", lambda device: "default")
    assert offered(8) == kernel.tuner_configs(8, 4096, 4096, 128) and offered(16)
    assert not offered(32)
    monkeypatch.setattr(kernel, "cuda_kernels", lambda device: "all")
    assert offered(32) == kernel.tuner_configs(32, 4096, 4096, 128, staged=True) and offered(128)
    assert any(c.stages for c in offered(8))  # the cp.async-staged configs: with "all" only, until measured
    assert not offered(256)
