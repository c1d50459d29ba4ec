"""The CUDA mma.sync W4A16 GEMM compiled for sm_90 here, without a GPU (NVRTC from its wheel, Triton's cuobjdump):
every kind of specialization builds, with the MMAs, shared loads, async copies and PDL instructions it should have
and no spills worth the name."""

from __future__ import annotations

import pytest
import torch

from lmd.turbomind.kernels import nvrtc
from lmd.turbomind.kernels.w4a16_mma_gemm import SHARED_LIMIT, MmaGemmConfig, kernel_source
from tests.turbomind.kernels import nvrtc_offline

SPECIALIZATIONS = [  # (dtype, group, config, pdl): both dtypes, warp rows 16/32/64, 1-8 warps, groups, stages
    (torch.float16, 128, MmaGemmConfig(2, 1, 16, 3, 1), True),
    (torch.float16, 128, MmaGemmConfig(2, 2, 32, 3, 1), True),
    (torch.float16, 32, MmaGemmConfig(2, 2, 64, 4, 1), False),
    (torch.float16, 64, MmaGemmConfig(4, 2, 64, 3, 1), True),
    (torch.bfloat16, 128, MmaGemmConfig(2, 1, 64, 4, 2), True),
    (torch.bfloat16, 32, MmaGemmConfig(1, 4, 32, 2, 1), False),
    (torch.float16, 128, MmaGemmConfig(2, 4, 32, 4, 1, False), True),
]


@pytest.mark.parametrize("spec", SPECIALIZATIONS, ids=lambda s: f"{str(s[0])[6:]}-g{s[1]}-"
                         f"{s[2].name().replace(' ', '_')}-pdl{int(s[3])}")
def test_specialization_compiles_for_sm90(offline, spec) -> None:
    dtype, group, cfg, pdl = spec
    usage, sass = nvrtc_offline.inspect(nvrtc.compile_cubin(kernel_source(dtype, group, cfg, pdl), "sm_90"))
    blocks = cfg.warp_m // 8
    # one k tile per loop trip: two k32 steps x two k16 steps x four weight tiles x the warp's n8 blocks
    assert sass.count("HMMA.16816.F32") == 2 * 2 * 4 * blocks
    # per k32 step two 16-byte shared loads of words and one of x per n8 block
    assert sass.count("LDS.128") == 2 * (2 + blocks)
    # global memory reaches shared memory only by cp.async (no register round trip), zero-fill past M included
    assert "LDGSTS.E.BYPASS.128" in sass and "LDG.E.128" not in sass
    assert ("ACQBULK" in sass) == pdl  # griddepcontrol.wait
    assert usage["STACK"] <= 16 and usage["REG"] <= 255  # at most a few scalars spilled, no arrays in local memory
    assert usage["SHARED"] <= 227 * 1024 - SHARED_LIMIT  # the static part fits the margin the limit leaves
