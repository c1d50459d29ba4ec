"""The CUDA wgmma W4A16 GEMM compiled for sm_90a here, without a GPU (NVRTC from its wheel, Triton's cuobjdump):
every kind of specialization builds within the registers 384 threads a CTA leave, with its warpgroup MMAs, mbarrier
waits and arrivals, async copies and PDL instructions."""

from __future__ import annotations

import pytest
import torch

from lmd.turbomind.kernels import nvrtc
from lmd.turbomind.kernels.w4a16_wgmma import SHARED_LIMIT, WgmmaConfig, kernel_source
from tests.turbomind.kernels import nvrtc_offline

SPECIALIZATIONS = [  # (dtype, group, config, pdl): both dtypes, every tile, groups, pipeline depths
    (torch.float16, 128, WgmmaConfig(128, 64, 6), True),
    (torch.float16, 128, WgmmaConfig(128, 128, 4), True),
    (torch.float16, 32, WgmmaConfig(256, 128, 3, 2), False),
    (torch.bfloat16, 64, WgmmaConfig(128, 256, 4), True),
    (torch.bfloat16, 128, WgmmaConfig(256, 64, 3, 1, False), False),
]


@pytest.mark.parametrize("spec", SPECIALIZATIONS, ids=lambda s: f"{str(s[0])[6:]}-g{s[1]}-"
                         f"{s[2].name().replace(' ', '_')}-pdl{int(s[3])}")
def test_specialization_compiles_for_sm90a(offline, spec) -> None:
    dtype, group, cfg, pdl = spec
    usage, sass = nvrtc_offline.inspect(nvrtc.compile_cubin(kernel_source(dtype, group, cfg, pdl), "sm_90a"))
    wgmmas = [line for line in sass.splitlines() if "HGMMA." in line]
    # every k tile: 4 k16 steps for each of a consumer's 64-channel slices, of n = block_t (the loop may be peeled)
    per_tile = 4 * cfg.block_n // 128
    assert wgmmas and len(wgmmas) % per_tile == 0
    assert all(f"HGMMA.64x{cfg.block_t}x16.F32{'.BF16' if dtype == torch.bfloat16 else ''} " in line for line in wgmmas)
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass  # one wgmma group left in flight while a stage is released
    assert "SYNCS.PHASECHK.TRANS64.TRYWAIT" in sass and "SYNCS.ARRIVE.TRANS64" in sass  # the mbarriers
    assert "LDGSTS.E.BYPASS.128" in sass and "FENCE.VIEW.ASYNC.S" in sass and "BAR.SYNC.DEFER_BLOCKING 0x1, 0x80" in sass
    assert ("ACQBULK" in sass) == pdl
    assert usage["REG"] <= 168 and usage["STACK"] == 0  # 65536 / 384 registers a thread, nothing spilled
    assert usage["SHARED"] <= 227 * 1024 - SHARED_LIMIT  # the static part fits the margin the limit leaves
