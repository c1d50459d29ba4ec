"""The CUDA mma.sync W4A16 GEMM without a GPU: its PyTorch twin and a lane-level emulation of its source (with the
shared-memory swizzles checked for bank conflicts) against the engine's reference, the host wrapper's errors, and
the tuner's configs."""

from __future__ import annotations

import pytest
import torch

from lmd.turbomind.kernels import w4a16_mma_gemm as kernel
from lmd.turbomind.kernels import w4a16_mma_gemv
from lmd.turbomind.kernels.w4a16_layout import w4a16_matmul_reference
from lmd.turbomind.kernels.w4a16_mma_gemm import MmaGemmConfig, mma_gemm, mma_gemm_reference
from tests.turbomind.kernels import mma_gemm_lanes
from tests.turbomind.kernels.mma_cases import DTYPES, ROW_LIMIT, engine_weights, lane_case, row_errors
from tests.turbomind.kernels.shared_memory_model import SharedMemory


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", w4a16_mma_gemv.GROUPS)
@pytest.mark.parametrize("word", [True, False])
def test_twin_matches_the_engine_reference(dtype, group, word) -> None:
    qweight, scales, zeros = engine_weights(128, 512, group, dtype)
    x = torch.randn(19, 512, dtype=dtype, generator=torch.Generator().manual_seed(1)) * 3
    ref = w4a16_matmul_reference(x.float(), qweight, scales, zeros).float()
    y = mma_gemm_reference(x, qweight, scales, zeros, word)
    assert row_errors(y, ref).max() < ROW_LIMIT[dtype] / 2  # one rounding of the weights and of the output


CASES = [  # (n, k, group, m, config): CTA tiles, warp rows 16/32/64, 2-4 stages, splits, token tiles, short tiles
    (128, 256, 128, 16, MmaGemmConfig(2, 1, 16, 3, 1)),
    (128, 512, 32, 40, MmaGemmConfig(2, 2, 16, 2, 2)),  # two scale rows a stage; two token tiles, the last of 8
    (256, 256, 64, 70, MmaGemmConfig(2, 1, 64, 4, 1)),  # a second token tile of 6 rows
    (128, 384, 128, 33, MmaGemmConfig(1, 2, 32, 3, 3)),  # 6 k tiles in three splits
    (256, 320, 64, 24, MmaGemmConfig(4, 1, 32, 2, 2)),  # 5 k tiles: splits of 3 and 2
    (128, 256, 32, 64, MmaGemmConfig(1, 4, 16, 4, 1, False)),  # four warps along tokens; pair decode
    (64, 128, 64, 100, MmaGemmConfig(1, 8, 16, 2, 1)),  # eight warps along tokens: half the threads copy no words
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}k{c[1]}g{c[2]}m{c[3]}-{c[4].name().replace(' ', '_')}")
def test_lane_emulation_of_the_kernel_matches_the_reference(dtype, case) -> None:
    n, k, group, m, cfg = case
    qweight, scales, zeros, x, bias, ref = lane_case(n, k, group, m, dtype)
    y, conflicts = mma_gemm_lanes.run(x, qweight, scales, zeros, bias, cfg)  # asserts one write per output
    assert y.shape == (m, n) and y.dtype == dtype
    assert row_errors(y, ref).max() < ROW_LIMIT[dtype]
    twin = mma_gemm_reference(x, qweight, scales, zeros, cfg.word_decode).float() + bias.float()
    assert row_errors(y, twin).max() < ROW_LIMIT[dtype] / 2
    assert conflicts == 0


def test_the_emulation_sees_an_unswizzled_layout_and_a_wrong_fragment_plan(monkeypatch) -> None:
    """x stored and read without its swizzle still computes right but meets bank conflicts; x paired with the
    wrong nibbles (the two PRMT selectors swapped) computes wrong."""
    qweight, scales, zeros = engine_weights(128, 256, 128, torch.float16)
    x = torch.randn(16, 256, dtype=torch.float16, generator=torch.Generator().manual_seed(3))
    ref = w4a16_matmul_reference(x.float(), qweight, scales, zeros).float()
    cfg = MmaGemmConfig(2, 1, 16, 3, 1)
    with monkeypatch.context() as patch:
        patch.setattr(mma_gemm_lanes, "x_chunk", lambda row, c: c)
        y, conflicts = mma_gemm_lanes.run(x, qweight, scales, zeros, None, cfg)
    assert row_errors(y, ref).max() < ROW_LIMIT[torch.float16] and conflicts > 0
    prmt = mma_gemm_lanes.prmt
    monkeypatch.setattr(mma_gemm_lanes, "prmt", lambda a, b, sel: prmt(a, b, sel ^ 0x7632 ^ 0x5410))
    y, _ = mma_gemm_lanes.run(x, qweight, scales, zeros, None, cfg)
    assert row_errors(y, ref).max() > 0.1


def test_the_bank_conflict_count_sees_an_unswizzled_layout() -> None:
    """Rows 128 bytes apart read at the same chunk by lanes g = 0, 1 of a phase: 16 of a phase's 32 words share a
    bank with another, in each of four phases."""
    smem = SharedMemory(64 * 128)
    g, t = torch.arange(32) >> 2, torch.arange(32) & 3
    smem.load(g * 128 + t * 16, 4)
    assert smem.conflicts == 4 * 16
    smem.conflicts = 0
    smem.load(g * 128 + (t ^ ((g & 1) << 2)) * 16, 4)  # the kernel's x swizzle
    smem.load(torch.zeros(32, dtype=torch.int64), 4)  # one address for all: a broadcast
    assert smem.conflicts == 0


def test_the_emulation_reads_the_constants_the_source_uses() -> None:
    for text in ("c ^ ((row & 3) << 1)", "c ^ ((row & 1) << 2)", "0x5410", "0x7632", "0x54005400u", "0x4C004C00u",
                 "0x41804180u", "(kt * BK + cp.s_row * 32) / GROUP", "wait_stages<STAGES - 2>()",
                 "W_STEP % 4 == 0 || u % 2 == 0 ? 0 : 64", "lds128(w_step + 128)", "lds64(at + 64, sw[2], sw[3])",
                 "x_chunk(xrow, 4 + t)", "b * 8 * BK * 2", "w_chunk(t, 16 * wn + g)", "ch + 1"):
        assert text in kernel.FRAGMENT + kernel.SOURCE, text


def test_kernel_source_specializes_by_dtype_and_config() -> None:
    fp16 = kernel.kernel_source(torch.float16, 32, MmaGemmConfig(4, 2, 64, 4, 2))
    bf16 = kernel.kernel_source(torch.bfloat16, 128, MmaGemmConfig(1, 1, 16, 2, 1), pdl=True)
    assert all(f"#define {d}\n" in fp16 for d in ("WARPS_N 4", "WARPS_M 2", "MB 8", "STAGES 4", "GROUP 32",
                                                    "WORD_DECODE 1", "PDL 0"))
    assert all(f"#define {d}\n" in bf16 for d in ("BF16 1", "MB 2", "WORD_DECODE 0", "PDL 1"))
    assert "__device__ __forceinline__ void units(" in fp16  # the shared fragment helpers come with it


def test_wrapper_and_config_reject_what_the_kernel_cannot_take() -> None:
    qweight, scales, zeros = engine_weights(192, 256, 128, torch.float16)  # N = 192: not whole 128-channel blocks
    with pytest.raises(ValueError, match="N % 128"):
        mma_gemm(torch.randn(16, 256, dtype=torch.float16), qweight, scales, zeros, None, MmaGemmConfig())
    with pytest.raises(ValueError, match="CUDA tensors"):
        mma_gemm(torch.randn(16, 256, dtype=torch.float16), qweight, scales, zeros, None, MmaGemmConfig(1, 2))
    with pytest.raises(ValueError, match="fp16/bf16 x"):
        mma_gemm(torch.randn(16, 256), qweight, scales, zeros, None, MmaGemmConfig(1, 2))
    for bad in ({"warp_m": 24}, {"warps_n": 4, "warps_m": 4}, {"warps_m": 3}, {"stages": 1}, {"split": 0}):
        with pytest.raises(ValueError, match="mma-gemm config"):
            MmaGemmConfig(**bad)
    assert not kernel.supports(MmaGemmConfig(1, 8, 64, 6), 4096, 4096, 32)  # 6 stages of 512 rows: too much


def test_launch_shape_leaves_no_split_empty() -> None:
    for k_tiles in range(1, 40):
        for split in (1, 2, 3, 4, 8, 16):
            (_, _, splits), per_split = kernel.launch_shape(MmaGemmConfig(split=split), 16, 128, 64 * k_tiles)
            assert splits <= split and (splits - 1) * per_split < k_tiles <= splits * per_split


def test_tuner_configs() -> None:
    assert kernel.tuner_configs(8, 4096, 4096, 128, 132) == []
    for bucket in (16, 64, 256, 4096):
        configs = kernel.tuner_configs(bucket, 11008, 4096, 128, 132)
        assert configs and len({c.name() for c in configs}) == len(configs)
        assert all(c.block_m <= bucket and kernel.supports(c, 11008, 4096, 128) for c in configs)
    assert any(c.split > 1 for c in kernel.tuner_configs(16, 4096, 4096, 128, 132))  # 32 tiles: split to fill SMs
    assert all(c.split == 1 for c in kernel.tuner_configs(4096, 4096, 4096, 128, 132))


def test_the_dispatcher_offers_it_only_when_enabled(monkeypatch) -> None:
    pytest.importorskip("triton")
    from lmd.turbomind.kernels import w4a16

    cpu = torch.device("cpu")
    assert not any(isinstance(p, MmaGemmConfig) for p in w4a16.candidates(64, 4096, 4096, 128, cpu))
    monkeypatch.setattr(w4a16_mma_gemv, "cuda_kernels", lambda device: "default")  # the default: the GEMV alone
    assert not any(isinstance(p, MmaGemmConfig) for p in w4a16.candidates(64, 4096, 4096, 128, cpu))
    monkeypatch.setattr(w4a16_mma_gemv, "cuda_kernels", lambda device: "all")
    offered = [p for p in w4a16.candidates(64, 4096, 4096, 128, cpu) if isinstance(p, MmaGemmConfig)]
    assert offered == kernel.tuner_configs(64, 4096, 4096, 128, 1)
