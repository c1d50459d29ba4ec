"""The CUDA mma.sync W4A16 kernel compiled for sm_90 here, without a GPU (NVRTC from its wheel, Triton's cuobjdump):
every kind of specialization builds, with the MMAs and PDL instructions it should have and no spills worth the name;
and the launch-config structs `nvrtc` hands to cuLaunchKernelEx match cuda.h."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lmd.turbomind.kernels import nvrtc
from lmd.turbomind.kernels.w4a16_mma_gemv import MmaGemvConfig, kernel_source
from tests.turbomind.kernels import nvrtc_offline

SPECIALIZATIONS = [  # (dtype, group, config, pdl): both dtypes, token blocks, groups, decodes, prefetch, PDL
    (torch.float16, 128, MmaGemvConfig(8, 4, 1, False), True),
    (torch.float16, 128, MmaGemvConfig(8, 4, 2, True), False),
    (torch.float16, 64, MmaGemvConfig(16, 8, 2, True), True),
    (torch.float16, 32, MmaGemvConfig(16, 2, 1, False, False), False),
    (torch.bfloat16, 128, MmaGemvConfig(8, 2, 4, True), True),
    (torch.bfloat16, 128, MmaGemvConfig(16, 4, 1, False), True),
    (torch.bfloat16, 64, MmaGemvConfig(8, 8, 1, False), False),
    (torch.float16, 128, MmaGemvConfig(32, 4, 2, True), True),
    (torch.bfloat16, 64, MmaGemvConfig(32, 8, 1, False, False), False),
]


@pytest.mark.parametrize("spec", SPECIALIZATIONS, ids=lambda s: f"{str(s[0])[6:]}-g{s[1]}-"
                         f"{s[2].name().replace(' ', '_')}-pdl{int(s[3])}")
def test_specialization_compiles_for_sm90(offline, spec) -> None:
    dtype, group, cfg, pdl = spec
    usage, sass = nvrtc_offline.inspect(nvrtc.compile_cubin(kernel_source(dtype, group, cfg, pdl), "sm_90"))
    steps, blocks = group // 32, cfg.block_m // 8
    # per k16 step and token block: four weight tiles, and (folding kernel, up to 16 rows) the offsets' MMA
    assert sass.count("HMMA.16816.F32") == steps * 2 * (4 if blocks >= 4 else 5) * blocks
    assert ("ACQBULK" in sass) == pdl  # griddepcontrol.wait
    # a group's words (two 16-byte loads a step) and its scales and zeros (two 8-byte loads each) through the
    # read-only path, issued at two places (before the loop, and for the next group); x through the coherent path
    # (under PDL the previous kernel wrote it)
    assert sass.count("LDG.E.NA.128.CONSTANT") == 2 * 2 * steps and sass.count("LDG.E.NA.64.CONSTANT") == 2 * 4
    assert "LDG.E.128 " in sass and "LDG.E.128.CONSTANT" not in sass
    assert usage["STACK"] <= 16 and usage["REG"] <= 255  # at most a few scalars spilled, no arrays in local memory


STAGED = [  # (dtype, group, config, pdl): cp.async stages, both dtypes, the folding and the dequantizing blocks
    (torch.float16, 128, MmaGemvConfig(8, 8, 4, stages=3), True),
    (torch.float16, 128, MmaGemvConfig(8, 4, 8, stages=4), False),
    (torch.bfloat16, 64, MmaGemvConfig(16, 4, 2, False, False, stages=2), True),
    (torch.float16, 32, MmaGemvConfig(32, 8, 4, stages=4), True),
]


@pytest.mark.parametrize("spec", STAGED, ids=lambda s: f"{str(s[0])[6:]}-g{s[1]}-"
                         f"{s[2].name().replace(' ', '_')}-pdl{int(s[3])}")
def test_staged_specialization_streams_weights_through_shared_memory(offline, spec) -> None:
    dtype, group, cfg, pdl = spec
    usage, sass = nvrtc_offline.inspect(nvrtc.compile_cubin(kernel_source(dtype, group, cfg, pdl), "sm_90"))
    steps = group // 32
    # the words and the scales and zeros only by cp.async (LDGSTS): 2 x 16 bytes a step and 4 x 8 bytes a group, at
    # the prologue's STAGES copies and the loop's refill; read back by shared loads; x still from global memory
    assert sass.count("LDGSTS") == (cfg.stages + 1) * (2 * steps + 4)
    assert "LDG.E.NA.128.CONSTANT" not in sass and "LDG.E.NA.64.CONSTANT" not in sass
    assert sass.count("LDS.128") == 2 * steps
    # the loop's cp.async.wait_group STAGES - 1 comes before the first shared load of the stage (the exit's wait 0 alone
    # would not do)
    wait = f"DEPBAR.LE SB0, 0x{cfg.stages - 1} "
    assert wait in sass and sass.index(wait) < sass.index("LDS.128")
    assert ("ACQBULK" in sass) == pdl
    assert usage["STACK"] <= 16 and usage["REG"] <= 128  # one group in registers (these four configs)


def test_compile_errors_name_the_line(offline) -> None:
    with pytest.raises(nvrtc.NvrtcUnavailable, match="NVRTC: .*error"):
        nvrtc.compile_cubin(kernel_source(torch.float16, 128, MmaGemvConfig()) + "\nint broken(", "sm_90")


def test_launch_structs_match_cuda_h(tmp_path: Path) -> None:
    """sizeof/offsetof of CUlaunchAttribute and CUlaunchConfig from the cuda.h Triton ships, against the ctypes
    mirrors (a wrong layout would hand the driver garbage on the first PDL launch)."""
    triton = pytest.importorskip("triton")
    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    if not (include / "cuda.h").exists() or shutil.which("gcc") is None:
        pytest.skip("needs gcc and Triton's cuda.h")
    src = tmp_path / "layout.c"
    src.write_text("""#include <stdio.h>
#include <stddef.h>
#include "cuda.h"
int main(void) {
    CUlaunchAttribute a;
    printf("%zu %zu %zu %zu %zu %zu %zu %d\\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
           (size_t)((char*)&a.value.programmaticStreamSerializationAllowed - (char*)&a), sizeof(CUlaunchConfig),
           offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),
           (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
    return 0;
}
""")
    subprocess.run(["gcc", f"-I{include}", str(src), "-o", str(tmp_path / "layout")], check=True)
    c_layout = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.split()
    config, attr = nvrtc.launch_config((7, 5, 1), (128, 1, 1), 0x1234, pdl=True)
    ours = [ctypes.sizeof(nvrtc._LaunchAttribute), nvrtc._LaunchAttribute.value.offset,
            nvrtc._LaunchAttribute.value.offset, ctypes.sizeof(nvrtc._LaunchConfig), nvrtc._LaunchConfig.stream.offset,
            nvrtc._LaunchConfig.attrs.offset, nvrtc._LaunchConfig.num_attrs.offset,
            nvrtc.PROGRAMMATIC_STREAM_SERIALIZATION]
    assert [int(v) for v in c_layout] == ours
    flag = int.from_bytes(bytes(attr)[nvrtc._LaunchAttribute.value.offset:][:4], "little")
    assert (attr.id, flag, config.num_attrs, config.grid_x, config.grid_y, config.stream) == (6, 1, 1, 7, 5, 0x1234)
    assert ctypes.addressof(config.attrs.contents) == ctypes.addressof(attr)
    assert nvrtc.launch_config((1, 1, 1), (32, 1, 1), 0, pdl=False)[0].num_attrs == 0
