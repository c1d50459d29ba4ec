"""The CUDA wgmma W4A16 GEMM compiled for sm_90a here, without a GPU (NVRTC from its wheel, Triton's cuobjdump):
every kind of specialization builds within the registers its CTAs an SM leave, with its warpgroup MMAs pipelined,
mbarrier waits and arrivals, async copies and PDL instructions."""

from __future__ import annotations

import re

import pytest
import torch

from lmd.turbomind.kernels import nvrtc
from lmd.turbomind.kernels.w4a16_wgmma import SHARED_LIMIT, THREADS, WgmmaConfig, ctas_per_sm, kernel_source
from tests.turbomind.kernels import nvrtc_offline

SPECIALIZATIONS = [  # (dtype, group, config, pdl): both dtypes, every tile, groups, pipeline depths, two CTAs an SM
    (torch.float16, 128, WgmmaConfig(128, 64, 6), True),
    (torch.float16, 64, WgmmaConfig(128, 64, 3, 0), True),
    (torch.float16, 128, WgmmaConfig(128, 128, 4), True),
    (torch.float16, 32, WgmmaConfig(256, 128, 3, 2), False),
    (torch.bfloat16, 64, WgmmaConfig(128, 256, 4), True),
    (torch.bfloat16, 128, WgmmaConfig(256, 64, 3, 1, False), False),
    (torch.float16, 128, WgmmaConfig(128, 128, 6, 0, rs=True), True),
    (torch.bfloat16, 32, WgmmaConfig(256, 128, 4, 1, rs=True), False),
    (torch.float16, 64, WgmmaConfig(128, 64, 6, 0, rs=True), True),
    (torch.float16, 128, WgmmaConfig(128, 256, 6, 0, rs=True, depth=3), True),  # 3 k16 steps in flight
    (torch.bfloat16, 128, WgmmaConfig(256, 128, 6, 1, rs=True, depth=3), False),
]


@pytest.mark.parametrize("spec", SPECIALIZATIONS, ids=lambda s: f"{str(s[0])[6:]}-g{s[1]}-"
                         f"{s[2].name().replace(' ', '_')}-pdl{int(s[3])}")
def test_specialization_compiles_for_sm90a(offline, spec) -> None:
    dtype, group, cfg, pdl = spec
    usage, sass = nvrtc_offline.inspect(nvrtc.compile_cubin(kernel_source(dtype, group, cfg, pdl), "sm_90a"))
    wgmmas = [line for line in sass.splitlines() if "HGMMA." in line]
    # every k tile: 4 k16 steps for each of a consumer's 64-channel slices, of n = block_t (the loop may be peeled);
    # under RS the A operand is a register (HGMMA ... R<a>, gdesc[...]), else a descriptor
    per_tile = 4 * cfg.block_n // 128
    assert wgmmas and len(wgmmas) % per_tile == 0
    assert all(bool(re.search(r"HGMMA\S* R\d+, R\d+, gdesc\[", line)) == cfg.rs for line in wgmmas)
    assert all(f"HGMMA.64x{cfg.block_t}x16.F32{'.BF16' if dtype == torch.bfloat16 else ''} " in line for line in wgmmas)
    # one wgmma group (RS: `depth` of them) left in flight while a stage is released (ptxas would serialize them,
    # with a wait after each, if anything but wgmma touched the accumulators inside the k loop), and no local memory
    # in that loop
    lines = sass.splitlines()
    first = next(i for i, line in enumerate(lines) if "HGMMA." in line)
    wait = next(i for i, line in enumerate(lines) if f"WARPGROUP.DEPBAR.LE gsb0, 0x{cfg.depth}" in line)
    assert first < wait and not any("STL" in line or "LDL" in line for line in lines[first:wait])
    assert not any("WARPGROUP.DEPBAR.LE gsb0, 0x0" in line for line in lines[first:wait])
    assert "SYNCS.PHASECHK.TRANS64.TRYWAIT" in sass and "SYNCS.ARRIVE.TRANS64" in sass  # the mbarriers
    # the copies by the TMA unit (x's box and the bulk copies of the weights), none by cp.async; SS: the decode's
    # fence and the producers' barrier
    assert "UTMALDG.2D" in sass and "UBLKCP.S.G" in sass and "LDGSTS" not in sass
    assert ("FENCE.VIEW.ASYNC.S" in sass and "BAR.SYNC.DEFER_BLOCKING 0x1, 0x80" in sass) == (not cfg.rs)
    assert ("ACQBULK" in sass) == pdl
    # the registers the launch bounds leave (65536 an SM over its CTAs' 384 threads, in 8s); a few scalars spilled
    # outside the loop at most (the 256 x 128 tile's consumers hold 128 accumulators)
    assert usage["REG"] <= 65536 // (THREADS * ctas_per_sm(cfg, group)) // 8 * 8 and usage["STACK"] <= 128
    assert usage["SHARED"] <= 227 * 1024 - SHARED_LIMIT  # the static part fits the margin the limit leaves
