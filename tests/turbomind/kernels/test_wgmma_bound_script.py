"""benchmarks/w4a16_wgmma_bound.py patches the wgmma kernel's source to take work out of it; each patch must still
find its text in the source (else the script would time the kernel as built under a variant's name), and each
variant must build for sm_90a like the kernel."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lmd.turbomind.kernels import w4a16_wgmma as wg

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import w4a16_wgmma_bound as bound  # noqa: E402


@pytest.mark.parametrize("variant", [v for v in bound.PATCHES if bound.PATCHES[v]])
def test_every_patch_finds_its_text(variant) -> None:
    cfg = wg.WgmmaConfig(256, 128, 6, 1, rs=variant.startswith("rs"))
    source = wg.kernel_source(torch.float16, 128, cfg)
    patched = bound.patched_source(source, variant)
    assert patched != source
    assert all(old not in patched for old, _ in bound.PATCHES[variant])


def test_the_variants_build(offline) -> None:
    from lmd.turbomind.kernels import nvrtc

    for variant in bound.PATCHES:
        cfg = wg.WgmmaConfig(128, 64, 3, 1, rs=variant.startswith("rs"))
        cubin = nvrtc.compile_cubin(bound.patched_source(wg.kernel_source(torch.float16, 128, cfg), variant), "sm_90a")
        assert cubin
