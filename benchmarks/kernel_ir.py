"""What Triton made of a W4A16 kernel config: registers, spills, and how the MMA gets its operands (GPU only).

    python3 benchmarks/kernel_ir.py [--n 11008] [--k 4096] [--m 16]

For each config prints: registers per thread, spills, shared memory, the MMA flavour in the TTGIR (Hopper's
warpgroup MMA `warp_group_dot` or the Ampere-style `mma` v2) and whether each operand comes from registers or from
shared memory (`memdesc`), plus the number of layout conversions (each one may be a round trip through shared memory).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmd.turbomind.kernels.w4a16_gemm import GemmConfig, _gemm_kernel  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemm_wt import DECODES, WtGemmConfig, _wt_kernel, frag_row_warps  # noqa: E402
from lmd.turbomind.kernels.w4a16_layout import quantize_to_engine  # noqa: E402


def compile_plan(plan, x, qw, s, z, out):
    m, k = x.shape
    n = qw.shape[1]
    group = k // s.shape[0]
    if isinstance(plan, WtGemmConfig):
        tiles = triton.cdiv(m, plan.block_m) * triton.cdiv(n, plan.block_n)
        return _wt_kernel[(tiles, 1)](x, qw, s, z, out, out, out, out, m, n, k, GROUP=group, HAS_BIAS=False,
                                      BLOCK_N=plan.block_n, BLOCK_M=plan.block_m, BLOCK_K=plan.block_k, SPLIT_K=1,
                                      DECODE=DECODES.index(plan.decode), PTX=True,
                                      EVEN=n % plan.block_n == 0 and k % plan.block_k == 0,
                                      ROWS=frag_row_warps(plan), USE_PDL=False,
                                      num_warps=plan.num_warps, num_stages=plan.num_stages)
    tiles = triton.cdiv(m, plan.block_m) * triton.cdiv(n, plan.block_n)
    return _gemm_kernel[(tiles, 1)](x, qw, s, z, out, out, out, out, m, n, k, GROUP=group, HAS_BIAS=False,
                                    BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, SPLIT_K=1,
                                    GROUP_M=8, NIBBLE_DOTS=plan.nibble_dots, num_warps=plan.num_warps,
                                    num_stages=plan.num_stages)


def describe(compiled) -> str:
    ttgir = compiled.asm["ttgir"]
    dots = [line.strip() for line in ttgir.splitlines() if "warp_group_dot " in line or "tt.dot " in line]
    kind = "wgmma" if any("warp_group_dot" in d for d in dots) else "mma-v2" if dots else "none"
    operands = []
    for d in dots:
        sig = d.split(":", 1)[-1]
        types = re.findall(r"(!ttg\.memdesc<[^>]*>|tensor<[^>]*>)", sig)
        operands.append(",".join("smem" if t.startswith("!ttg.memdesc") else "reg" for t in types[:2]))
    converts = ttgir.count("ttg.convert_layout")
    allocs = ttgir.count("ttg.local_alloc")
    return (f"regs {compiled.n_regs} spills {compiled.n_spills} smem {compiled.metadata.shared} B | {kind} "
            f"A,B from {sorted(set(operands))} | convert_layout {converts} local_alloc {allocs}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=11008)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--m", type=int, default=16)
    args = parser.parse_args()
    dev = torch.device("cuda")
    qw, s, z = quantize_to_engine(torch.randn(args.n, args.k, device=dev) * 0.02, 128, torch.float16)
    x = torch.randn(args.m, args.k, device=dev, dtype=torch.float16)
    out = torch.empty(args.m, args.n, device=dev, dtype=torch.float16)
    bm = max(16, min(args.m, 128))
    plans = [GemmConfig(max(16, min(args.m, 64)), 128, 64, 1, num_stages=1),
             WtGemmConfig(64, bm, 128, 1, 4, 3, "interleave"), WtGemmConfig(64, bm, 128, 1, 4, 3, "asm"),
             WtGemmConfig(64, bm, 64, 1, 4, 3, "asm"), WtGemmConfig(128, bm, 64, 1, 8, 3, "asm")]
    for plan in plans:
        try:
            compiled = compile_plan(plan, x, qw, s, z, out)
            print(f"{plan.name():32s} {describe(compiled)}", flush=True)
            if os.environ.get("OUT"):  # the full IR, to read what each layout conversion is for
                name = plan.name().replace(" ", "_")
                Path(os.environ["OUT"], f"{name}_m{args.m}.ttgir").write_text(compiled.asm["ttgir"])
        except Exception as e:  # a config the compiler rejects
            print(f"{plan.name():32s} failed: {str(e).splitlines()[0][:160]}", flush=True)


if __name__ == "__main__":
    main()
