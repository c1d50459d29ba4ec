"""The CUDA wgmma W4A16 GEMM without a GPU: a lane-level emulation of its source (copies, decode, stores and bank
conflicts; the descriptors read through wgmma's canonical layout; the D register layout) against the engine's
reference and the PyTorch twin, the host wrapper's errors, the tuner's configs and the generated wgmma statement."""

from __future__ import annotations

import pytest
import torch

from lmd.turbomind.kernels import w4a16_mma_gemv
from lmd.turbomind.kernels import w4a16_wgmma as kernel
from lmd.turbomind.kernels.w4a16_layout import w4a16_matmul_reference
from lmd.turbomind.kernels.w4a16_mma_gemm import mma_gemm_reference
from lmd.turbomind.kernels.w4a16_wgmma import WgmmaConfig, wgmma_gemm
from tests.turbomind.kernels import wgmma_lanes
from tests.turbomind.kernels.mma_cases import DTYPES, ROW_LIMIT, engine_weights, lane_case, row_errors

CASES = [  # (n, k, group, m, config, resident CTAs): both channel blocks, token tiles 64-256, pipelines 3-6, short
    # tiles; one CTA a tile, several, and stream-K with CTAs that take several tiles and share some
    (128, 256, 128, 64, WgmmaConfig(128, 64, 3), 132),
    (256, 512, 32, 100, WgmmaConfig(256, 128, 4, 2), 132),  # two scale rows a stage; a 100-row tile; two CTAs a tile
    (128, 384, 64, 70, WgmmaConfig(128, 64, 5, 1, False), 132),  # a second token tile of 6 rows; pair decode
    (256, 320, 64, 64, WgmmaConfig(128, 256, 6, 3), 132),  # 5 k tiles over 3 CTAs a tile; two channel blocks
    (128, 768, 64, 128, WgmmaConfig(128, 128, 4), 132),  # 12 k tiles: every stage refilled several times
    (384, 256, 128, 200, WgmmaConfig(128, 64, 3, 0), 5),  # stream-K: 12 tiles x 4 k tiles on 5 CTAs
    (256, 512, 64, 64, WgmmaConfig(128, 64, 4, 0), 3),  # stream-K: 2 tiles x 8 k tiles on 3 CTAs
    (128, 128, 32, 130, WgmmaConfig(128, 128, 3, 0), 7),  # stream-K with more CTAs than... 4 iterations: G = 4
    (128, 256, 128, 64, WgmmaConfig(128, 64, 3, rs=True), 132),  # RS: A decoded into the consumers' registers
    (256, 512, 32, 100, WgmmaConfig(256, 128, 4, 0, rs=True), 3),  # RS, two scale rows a stage, stream-K
    (128, 384, 64, 70, WgmmaConfig(128, 64, 5, 2, rs=True), 132),  # RS, two CTAs a tile, a 6-row second tile
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}k{c[1]}g{c[2]}m{c[3]}-{c[4].name().replace(' ', '_')}"
                         f"-r{c[5]}")
def test_lane_emulation_of_the_kernel_matches_the_reference(dtype, case) -> None:
    n, k, group, m, cfg, resident = case
    qweight, scales, zeros, x, bias, ref = lane_case(n, k, group, m, dtype)
    # asserts every output written once, each stage's bytes as STAGE_TX says and the counters reset at the end
    y, conflicts = wgmma_lanes.run(x, qweight, scales, zeros, bias, cfg, resident)
    assert y.shape == (m, n) and y.dtype == dtype
    assert row_errors(y, ref).max() < ROW_LIMIT[dtype]
    twin = mma_gemm_reference(x, qweight, scales, zeros, cfg.word_decode).float() + bias.float()
    assert row_errors(y, twin).max() < ROW_LIMIT[dtype] / 2
    assert conflicts == 0


def test_the_emulation_reads_through_the_descriptors(monkeypatch) -> None:
    """Descriptors with the leading and stride byte offsets swapped (the layout written is unchanged) compute
    wrong."""
    qweight, scales, zeros, x, bias, ref = lane_case(128, 256, 128, 64, torch.float16)
    cfg = WgmmaConfig(128, 64, 3)
    encode = wgmma_lanes.descriptor
    monkeypatch.setattr(wgmma_lanes, "descriptor",
                        lambda address: (encode(address) & 0x3FFF) | (64 << 16) | (8 << 32))
    y, _ = wgmma_lanes.run(x, qweight, scales, zeros, bias, cfg)
    assert row_errors(y, ref).max() > 0.1


def test_the_emulation_reads_x_through_the_swizzle(monkeypatch) -> None:
    """x's descriptor without the 128-byte swizzle (layout type 0; the layout written is unchanged) computes wrong,
    and so does one whose k16 step moves by an unswizzled core matrix's 256 bytes: the emulation applies the XOR."""
    qweight, scales, zeros, x, bias, ref = lane_case(128, 256, 128, 64, torch.float16)
    encode = wgmma_lanes.swizzled_descriptor
    monkeypatch.setattr(wgmma_lanes, "swizzled_descriptor", lambda address: encode(address) & ~(3 << 62))
    y, _ = wgmma_lanes.run(x, qweight, scales, zeros, bias, WgmmaConfig(128, 64, 3, rs=True))
    assert row_errors(y, ref).max() > 0.1


def test_stage_layout() -> None:
    """Every stage's x starts on a 1024-byte swizzle atom, and the regions follow one another without overlap."""
    for cfg in (WgmmaConfig(128, 64, 3), WgmmaConfig(256, 128, 6, rs=True), WgmmaConfig(128, 256, 4)):
        for group in (32, 64, 128):
            layout = kernel.stage_layout(cfg, group)
            assert layout["X_OFFSET"] == 0 and layout["STAGE_BYTES"] % 1024 == 0
            assert layout["A_OFFSET"] == cfg.block_t * 128
            assert layout["RAW_OFFSET"] == layout["A_OFFSET"] + (0 if cfg.rs else cfg.block_n * 128)
            assert layout["SC_OFFSET"] == layout["RAW_OFFSET"] + 32 * cfg.block_n
            assert layout["SC_OFFSET"] + 2 * layout["SC_BYTES"] <= layout["STAGE_BYTES"]
            assert layout["STAGE_BYTES"] - (layout["SC_OFFSET"] + 2 * layout["SC_BYTES"]) < 1024


def test_the_rs_emulation_catches_a_wrong_pair_selector(monkeypatch) -> None:
    """RS: each lane's PRMT selector picks byte t of the word; the neighbouring byte (t + 1) computes wrong."""
    qweight, scales, zeros, x, bias, ref = lane_case(128, 256, 128, 64, torch.float16)
    prmt_lanes = wgmma_lanes.prmt_lanes
    monkeypatch.setattr(wgmma_lanes, "prmt_lanes", lambda a, b, sel: prmt_lanes(a, b, (sel + 0x1111) & 0x7777))
    y, _ = wgmma_lanes.run(x, qweight, scales, zeros, bias, WgmmaConfig(128, 64, 3, rs=True))
    assert row_errors(y, ref).max() > 0.1


def test_the_emulation_reads_the_layout_the_source_uses() -> None:
    for text in ("#define CORE_LBO 128", "#define CORE_SBO 1024",
                 "(row >> 3) * CORE_SBO + k8 * CORE_LBO + (row & 7) * 16",
                 "((u64)(CORE_LBO >> 4) << 16) | ((u64)(CORE_SBO >> 4) << 32)",
                 "((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62)",
                 "tensor_copy(stage + X_OFFSET, &x_map, w.kt * BK, w.m0, full + 8 * sj)",
                 "tensor_copy(base + j * STAGE_BYTES + X_OFFSET, &x_map, v.kt * BK, v.m0, full + 8 * j)",
                 "bulk_copy(stage + RAW_OFFSET + r * BN * 4, qw + (u64)(kt * 8 + r) * N + n0, BN * 4, barrier)",
                 "(u64)((kt * BK + r * 32) / GROUP) * N + n0", "SC_OFFSET + SC_BYTES + r * BN * 2",
                 "#define STAGE_TX (BT * BK * 2 + 8 * BN * 4 + 2 * SC_BYTES)",
                 "barrier_wait(ready + 8 * s, (i / STAGES) & 1)",
                 "const u32 dequantized = empty + 8 * STAGES, ready = RS ? full : dequantized;",
                 "(slice0 + e) * 8 * CORE_SBO + kk * 2 * CORE_LBO", "swizzled_descriptor(stage + X_OFFSET + kk * 32)",
                 "prmt(p04, p15, 0x5410)", "prmt(p26, p37, 0x7632)", "(r / 4) % SROWS",
                 "(((it + 1) * gridDim.x - 1) / total)", "first_kt != 0 || last_kt != KT - 1",
                 "count - i < KT - w.kt ? count - i : KT - w.kt", "step > 0 || kk > 0",
                 "blockIdx.x * total / gridDim.x",
                 "(tile % tiles_m) * BT", "(tile / tiles_m) * BN", "(((e * (BT / 2) + j) / 4) * 256 + p) * 4",
                 "w.kt + 1 < KT ? work_of(w.tile, w.kt + 1, tiles_m, rows) : work_of(w.tile + 1, 0, tiles_m, rows)",
                 "2 * c + (int)(c * total / gridDim.x / KT != tile)",
                 "atomicAdd(counters + w.tile, 1) == last_owner - first_owner",
                 "barrier_init(empty + 8 * s, 2)", "((j / STAGES) & 1) ^ 1", "(i / STAGES) & 1", "wgmma_wait<1>()",
                 "if (!previous_released && threadIdx.x % 128 == 0) barrier_arrive(empty + 8 * ((i - 1) % STAGES));",
                 "if (threadIdx.x % 128 == 0) barrier_arrive(empty + 8 * ((i - 1) % STAGES));\n"
                 "        previous_released = true;",
                 "#define PREFETCH (RS ? STAGES - 1 : STAGES - 2)", "t | (t << 4) | ((4 + t) << 8) | ((4 + t) << 12)",
                 "#define MAGIC2 0x43004300u", "#define MAGIC2 0x64006400u", "prmt(q, q >> 4, select)",
                 "(2 * kk + (r >> 1)) * BN * 4 + (n + 8 * (r & 1)) * 4", "(kk / 2) % SROWS * BN * 2 + n * 2",
                 "lds16(at + 16 * h)", "a[kk % SETS][e][r]",
                 "wgmma_wait<RS_DEPTH>();", "if (kk == RS_DEPTH - 1) {", "#define SETS (RS_DEPTH + 1)"):
        assert text in kernel.SOURCE, text


def test_the_wgmma_statement() -> None:
    text = kernel.wgmma_tile_source(torch.bfloat16, 64, rs=False)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1," in text
    assert "%31}, %32, %33, p, 1, 1, 0, 0" in text
    assert text.count('"+f"(d[') == 32 and "setp.ne.b32 p, %34, 0" in text
    source = kernel.kernel_source(torch.float16, 32, WgmmaConfig(256, 128, 3, 2), pdl=True)
    assert all(f"#define {d}\n" in source for d in ("BN 256", "BT 128", "STAGES 3", "GROUP 32", "WORD_DECODE 1", "PDL 1"))
    assert "m64n128k16.f32.f16.f16" in source and "#define RS 0\n" in source and "void wgmma_tile_rs" not in source
    rs = kernel.kernel_source(torch.bfloat16, 64, WgmmaConfig(128, 64, 3, 0, rs=True))
    assert "#define RS 1\n" in rs and "{%32, %33, %34, %35}, %36, p, 1, 1, 0;" in rs  # A registers, no trans-a
    assert "#define CTAS_PER_SM 2\n" in rs


def test_wrapper_and_config_reject_what_the_kernel_cannot_take() -> None:
    qweight, scales, zeros = engine_weights(192, 256, 128, torch.float16)
    with pytest.raises(ValueError, match="N % 128"):
        wgmma_gemm(torch.randn(64, 256, dtype=torch.float16), qweight, scales, zeros, None, WgmmaConfig())
    qweight, scales, zeros = engine_weights(128, 256, 128, torch.float16)
    with pytest.raises(ValueError, match="CUDA tensors"):
        wgmma_gemm(torch.randn(64, 256, dtype=torch.float16), qweight, scales, zeros, None, WgmmaConfig())
    for bad in ({"block_n": 64}, {"block_t": 32}, {"block_n": 256, "block_t": 256}, {"stages": 2}, {"split": -1},
                {"rs": True, "word_decode": False}, {"depth": 3}, {"rs": True, "depth": 2}):
        with pytest.raises(ValueError, match="wgmma config"):
            WgmmaConfig(**bad)
    assert not kernel.supports(WgmmaConfig(256, 128, 4), 4096, 4096, 128)  # 4 stages of 58 KiB: too much


def test_tuner_configs() -> None:
    assert kernel.tuner_configs(32, 4096, 4096, 128) == []
    for bucket in (64, 256, 4096):
        configs = kernel.tuner_configs(bucket, 11008, 4096, 128)
        assert configs and len({c.name() for c in configs}) == len(configs)
        assert all(c.block_t <= bucket and kernel.supports(c, 11008, 4096, 128) for c in configs)
        assert {c.split for c in configs} == {0, 1}  # one CTA a tile, and stream-K
        assert {c.rs for c in configs} == {False, True}
    assert not any(c.block_n == 256 for c in kernel.tuner_configs(4096, 33 * 128, 4096, 128))


def test_grid_sizes() -> None:
    cfg = WgmmaConfig(128, 128, 4)
    assert kernel.iterations(cfg, 256, 11008, 4096) == (172, 172 * 64)
    assert kernel.grid_size(cfg, 256, 11008, 4096, 132) == 172
    assert kernel.grid_size(WgmmaConfig(128, 128, 4, 3), 256, 11008, 4096, 132) == 516
    assert kernel.grid_size(WgmmaConfig(128, 128, 4, 0), 256, 11008, 4096, 132) == 132
    assert kernel.grid_size(WgmmaConfig(128, 128, 4, 0), 100, 128, 128, 132) == 2  # never more than the iterations
    assert WgmmaConfig(128, 64, 3, 0).name() == "wgmma n128 t64 s3 stream"


def test_the_dispatcher_offers_it_on_sm90_rs_from_256_rows_by_default_and_all_with_1(monkeypatch) -> None:
    pytest.importorskip("triton")
    from lmd.turbomind.kernels import w4a16

    cpu = torch.device("cpu")

    def offered(bucket: int) -> list:
        return [p for p in w4a16.candidates(bucket, 4096, 4096, 128, cpu) if isinstance(p, WgmmaConfig)]

    assert not offered(256)  # not an sm_90 device
    monkeypatch.setattr(kernel, "runs_on", lambda device: True)
    monkeypatch.setattr(w4a16_mma_gemv, "cuda_kernels", lambda device: "none")
    assert not offered(256)
    monkeypatch.setattr(w4a16_mma_gemv, "cuda_kernels", lambda device: "default")
    assert not offered(128)
    assert offered(256) == [c for c in kernel.tuner_configs(256, 4096, 4096, 128) if c.rs and c.depth == 1]
    assert offered(4096) and {c.depth for c in kernel.tuner_configs(256, 4096, 4096, 128) if c.rs} == {1, 3}
    monkeypatch.setattr(w4a16_mma_gemv, "cuda_kernels", lambda device: "all")
    assert offered(256) == kernel.tuner_configs(256, 4096, 4096, 128) and offered(64)


def test_partial_slots_have_a_workspace_of_their_own(monkeypatch) -> None:
    """The wgmma GEMM leaves its partial slots as written; the kernels that add atomically need theirs all-zero, so
    the two never share a buffer (the slots in the zeroed one would corrupt the next split-K launch)."""
    from types import SimpleNamespace

    from lmd.turbomind.kernels.w4a16_epilogue import SplitKWorkspace

    cpu = torch.device("cpu")
    assert SplitKWorkspace.get(cpu, 16, 1)[0].data_ptr() != SplitKWorkspace.get(cpu, 16, 1, "partials")[0].data_ptr()
    seen: dict = {}
    monkeypatch.setattr(kernel, "launch_w4a16", lambda *args, **kwargs: seen.update(kwargs, args=args))
    monkeypatch.setattr(kernel.torch.cuda, "get_device_properties", lambda device: SimpleNamespace(
        multi_processor_count=132))
    monkeypatch.setattr(kernel, "x_tensor_map", lambda x, cfg: b"")
    qweight, scales, zeros = engine_weights(256, 256, 128, torch.float16)
    x = torch.randn(256, 256, dtype=torch.float16)
    kernel.launch_with(None, x, qweight, scales, zeros, None, WgmmaConfig(128, 128, 4, 0, rs=True))
    assert seen["workspace_kind"] == "partials"
    tiles, total = kernel.iterations(WgmmaConfig(128, 128, 4, 0, rs=True), 256, 256, 256)
    assert seen["args"][8] == tiles and seen["args"][11] == 2 * min(total, 132) * 128 * 128  # counters, slots


def test_reference_and_emulation_agree_on_a_tile_of_zeros_past_m() -> None:
    """Rows past M are zero-filled in shared memory, never read from x: a 1-row x gives its own row."""
    qweight, scales, zeros = engine_weights(128, 128, 64, torch.float16)
    x = torch.randn(1, 128, dtype=torch.float16, generator=torch.Generator().manual_seed(5))
    y, _ = wgmma_lanes.run(x, qweight, scales, zeros, None, WgmmaConfig(128, 64, 3))
    ref = w4a16_matmul_reference(x.float(), qweight, scales, zeros).float()
    assert row_errors(y, ref).max() < ROW_LIMIT[torch.float16]
