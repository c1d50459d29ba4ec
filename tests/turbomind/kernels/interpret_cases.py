"""Every W4A16 kernel path on small shapes under TRITON_INTERPRET=1, against the fp32 reference.

Run as a script (a fresh process, so the interpreter is chosen before Triton decorates any kernel); prints one JSON
object: case name -> relative error (or the exception text), plus "workspace_clean" (split-K state back to zero).
test_w4a16_interpret.py runs it once and asserts on each case.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import dataclass

if __name__ == "__main__":  # imported by the test only for the case list: leave that process's Triton alone
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from lmd.turbomind.kernels.w4a16 import default_plan, m_bucket, run_plan, w4a16_linear  # noqa: E402
from lmd.turbomind.kernels.w4a16_dequant import DequantConfig, dequantize_triton  # noqa: E402
from lmd.turbomind.kernels.w4a16_epilogue import SplitKWorkspace  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemm import GemmConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemm_wt import WtGemmConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemv import GemvConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_layout import dequantize, quantize_to_engine, w4a16_matmul_reference  # noqa: E402
from tests.turbomind.kernels.interpreter import run_jobs  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    plan: object | None  # None: through the dispatcher (w4a16_linear, untuned default plan)
    m: int
    n: int
    k: int
    group: int
    bias: bool = False
    outliers: bool = False  # a few activation channels 1000x the rest (LLM hidden states have such channels)


def _cases() -> list[Case]:
    out: list[Case] = []
    for m, bm, n, k, g, split, bias in ((1, 1, 128, 256, 128, 4, False), (1, 1, 64, 256, 32, 3, True),
                                        (2, 2, 128, 128, 64, 2, True), (3, 4, 64, 256, 64, 5, False)):
        out.append(Case(f"gemv-m{m}-g{g}", GemvConfig(64, 8, split, 1, 1, bm), m, n, k, g, bias))
    # slices of many steps: dot and xs run on within a group and fold at its end, or where a slice ends mid-group
    out.append(Case("gemv-m1-g64-steps16", GemvConfig(64, 1, 2, 1, 1, 1), 1, 128, 256, 64))
    out.append(Case("gemv-m1-g64-steps11-midgroup", GemvConfig(64, 1, 3, 1, 1, 1), 1, 96, 256, 64, True))
    out.append(Case("gemv-m3-g64-steps6-midgroup", GemvConfig(64, 2, 3, 1, 1, 4), 3, 128, 256, 64))
    out.append(Case("gemv-m2-g128-steps8", GemvConfig(32, 2, 2, 1, 1, 2), 2, 64, 512, 128))
    out.append(Case("gemv-m1-g128-outliers", GemvConfig(64, 2, 2, 1, 1, 1), 1, 128, 512, 128, outliers=True))
    # K not a multiple of the step: the last step's masked x and weight loads, on the first token row too
    out.append(Case("gemv-m1-g64-uneven-k", GemvConfig(64, 16, 2, 1, 1, 1), 1, 128, 320, 64))
    out.append(Case("gemv-m3-g32-uneven-k", GemvConfig(64, 8, 2, 1, 1, 4), 3, 64, 224, 32, True))
    for m, bm, bn, bk, g, split in ((7, 16, 64, 64, 64, 2), (16, 16, 32, 128, 64, 3), (33, 32, 64, 32, 32, 4)):
        out.append(Case(f"gemm-splitk-m{m}-g{g}", GemmConfig(bm, bn, bk, split), m, 128, 256, g, m % 2 == 1))
    for m, bm, g, split in ((2, 16, 128, 2), (16, 16, 64, 3), (64, 64, 128, 1)):
        out.append(Case(f"gemm-nibble-dots-m{m}-g{g}", GemmConfig(bm, 64, 128, split, nibble_dots=True), m, 128,
                        256, g, m == 16))
    for m, g in ((64, 64), (128, 128), (256, 64)):
        out.append(Case(f"gemm-tiled-m{m}-g{g}", GemmConfig(64, 64, 64, 1, group_m=2), m, 128, 256, g, m == 128))
    for m, bn, bm, bk, g, split, decode in ((1, 64, 16, 64, 64, 2, "load"), (3, 32, 16, 128, 128, 1, "interleave"),
                                            (16, 64, 16, 32, 32, 3, "interleave"), (40, 32, 32, 64, 64, 1, "load"),
                                            (2, 32, 16, 64, 64, 2, "asm"), (20, 64, 32, 256, 128, 1, "asm"),
                                            (5, 32, 16, 64, 32, 2, "frag"), (17, 64, 32, 256, 128, 1, "frag")):
        out.append(Case(f"wt-{decode}-m{m}-g{g}", WtGemmConfig(bn, bm, bk, split, decode=decode), m, 96, 256, g,
                        m == 3))
    # frag with its row order (BLOCK_N a multiple of 16 per warp) on whole tiles: the unmasked loads
    out.append(Case("wt-frag-rows-even-m3-g64", WtGemmConfig(64, 16, 64, 2, decode="frag"), 3, 128, 256, 64, True))
    out.append(Case("wt-frag-rows-8warps-m9-g128", WtGemmConfig(128, 16, 128, 1, num_warps=8, decode="frag"), 9,
                    256, 256, 128))
    out.append(Case("wt-fragx-m40-g64", WtGemmConfig(64, 32, 64, 2, decode="frag-x"), 40, 128, 256, 64, True))
    out.append(Case("wt-fragx-masked-m70-g32", WtGemmConfig(64, 64, 32, 1, decode="frag-x"), 70, 96, 128, 32))
    for m, g in ((33, 64), (256, 128)):
        out.append(Case(f"dequant-cublas-m{m}-g{g}", DequantConfig(8, 64), m, 128, 256, g, m == 33))
    for m in (1, 2, 3, 7, 16, 33, 64, 128, 256):
        out.append(Case(f"dispatch-m{m}", None, m, 128, 128, 64, m % 3 == 0))
    return out


CASES = _cases()


def run_case(case: Case) -> float:
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    w = torch.randn(case.n, case.k, generator=gen) * 0.05
    qw, s, z = quantize_to_engine(w, case.group, torch.float16)
    x = torch.randn(case.m, case.k, generator=gen)
    if case.outliers:
        x[:, 3::97] *= 1000.0
    x = x.to(torch.float16)
    bias = torch.randn(case.n, generator=gen).to(torch.float16) if case.bias else None
    ref = w4a16_matmul_reference(x, qw, s, z).float()
    if bias is not None:
        ref = ref + bias.float()
    if case.plan is None:
        y = w4a16_linear(x.reshape(1, case.m, case.k), qw, s, z, bias).reshape(case.m, case.n)
        assert m_bucket(case.m) >= case.m and default_plan(m_bucket(case.m), case.n, case.k, case.group, x.device)
    else:
        y = run_plan(case.plan, x, qw, s, z, bias)
    assert y.shape == (case.m, case.n) and y.dtype == x.dtype
    return ((y.float() - ref).norm() / ref.norm()).item()


def main() -> None:
    results = run_jobs({case.name: (lambda case=case: run_case(case)) for case in CASES}, limit=3)
    qw, s, z = quantize_to_engine(torch.randn(64, 128), 32, torch.float16)
    results["dequant-kernel"] = (dequantize_triton(qw, s, z, torch.float16).float()
                                 - dequantize(qw, s, z).float()).abs().max().item()
    results["workspace_clean"] = all(bool((ws == 0).all()) and bool((cnt == 0).all())
                                     for (_, _, kind), (ws, cnt) in SplitKWorkspace._buffers.items()
                                     if kind == "zeroed")
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
