"""What Triton made of a W4A16 kernel config: registers, spills, and how the MMA gets its operands.

    python3 benchmarks/kernel_ir.py [--n 11008] [--k 4096] [--m 16] [--offline]

For each config prints: registers per thread, spills, shared memory, the MMA flavour in the TTGIR (Hopper's
warpgroup MMA `warp_group_dot` or the Ampere-style `mma` v2) and whether each operand comes from registers or from
shared memory (`memdesc`), plus the number of layout conversions (each one may be a round trip through shared memory)
and the `pendings` of each warpgroup-MMA wait (0: the MMA is waited for before anything else runs, so nothing
overlaps it within the warpgroup).

`--offline` needs no GPU: the kernels compile here for sm_90a with Triton's own ptxas (registers and spills from
`ptxas -v`), as the engine launches them (PDL on; pointers, N and K specialized as divisible by 16, as a launch on
the Llama shapes specializes them). Which Triton matters: to see what the H200 machine's Triton 3.6
makes, run it with that version (a venv with `pip install triton==3.6.0 torch`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
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


def compile_offline(plan, m: int, n: int, k: int, group: int = 128):
    """`compile_plan`'s kernel compiled for sm_90a on this machine (no GPU); (compiled, regs, spills)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"x_ptr": "*fp16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "bias_ptr": "*fp16",
           "out_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32"}
    common = {"GROUP": group, "HAS_BIAS": False, "BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n,
              "BLOCK_K": plan.block_k, "SPLIT_K": 1}
    if isinstance(plan, WtGemmConfig):
        fn = _wt_kernel
        consts = {**common, "DECODE": DECODES.index(plan.decode), "PTX": True,
                  "EVEN": n % plan.block_n == 0 and k % plan.block_k == 0, "ROWS": frag_row_warps(plan),
                  "USE_PDL": True}
    else:
        fn, consts = _gemm_kernel, {**common, "GROUP_M": 8, "NIBBLE_DOTS": plan.nibble_dots}
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts,
                    attrs=divisible_by_16(fn, [name for name in sig if name != "M"]))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": plan.num_warps, "num_stages": plan.num_stages})
    regs, spills, _ = ptxas_report(compiled.asm["ptx"])
    return compiled, regs, spills


def divisible_by_16(fn, names: list[str]) -> dict:
    """The specialization a launch gives `names` (pointers to aligned tensors, ints that are multiples of 16): without
    it an offline compile assumes nothing and loses the vector loads a real launch gets."""
    return {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in names}


def ptxas_report(ptx_text: str) -> tuple[int, int, str]:
    """Registers per thread and spill bytes of PTX assembled for sm_90a by Triton's own ptxas (-1: not reported),
    and ptxas's full report."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp, "kernel.ptx")
        ptx.write_text(ptx_text)
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp, "k.cubin"))],
                                capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1, report


def describe(compiled, regs: int | None = None, spills: int | None = None) -> str:
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
    pendings = re.findall(r"warp_group_dot_wait .*pendings = (\d+)", ttgir)
    regs = compiled.n_regs if regs is None else regs
    spills = compiled.n_spills if spills is None else spills
    return (f"regs {regs} spills {spills} smem {compiled.metadata.shared} B | {kind} "
            f"A,B from {sorted(set(operands))} | convert_layout {converts} local_alloc {allocs} | "
            f"MMA waits, pendings {pendings}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=11008)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--offline", action="store_true", help="compile for sm_90a here, no GPU (see above)")
    args = parser.parse_args()
    if not args.offline:
        dev = torch.device("cuda")
        qw, s, z = quantize_to_engine(torch.randn(args.n, args.k, device=dev) * 0.02, 128, torch.float16)
        x = torch.randn(args.m, args.k, device=dev, dtype=torch.float16)
        out = torch.empty(args.m, args.n, device=dev, dtype=torch.float16)
    bm = max(16, min(args.m, 128))
    plans = [GemmConfig(max(16, min(args.m, 64)), 128, 64, 1, num_stages=1),
             WtGemmConfig(64, bm, 128, 1, 4, 3, "interleave"), WtGemmConfig(64, bm, 128, 1, 4, 3, "asm"),
             WtGemmConfig(64, bm, 64, 1, 4, 3, "asm"), WtGemmConfig(128, bm, 64, 1, 8, 3, "asm"),
             WtGemmConfig(64, bm, 64, 1, 4, 4, "frag-x")]
    print(f"Triton {triton.__version__}, {'sm_90a offline' if args.offline else torch.cuda.get_device_name()}")
    for plan in plans:
        try:
            if args.offline:
                compiled, regs, spills = compile_offline(plan, args.m, args.n, args.k)
                print(f"{plan.name():32s} {describe(compiled, regs, spills)}", flush=True)
            else:
                compiled = compile_plan(plan, x, qw, s, z, out)
                print(f"{plan.name():32s} {describe(compiled)}", flush=True)
            if os.environ.get("OUT"):  # the full IR, to read what each layout conversion is for
                name = plan.name().replace(" ", "_")
                Path(os.environ["OUT"], f"{name}_m{args.m}.ttgir").write_text(compiled.asm["ttgir"])
        except Exception as e:  # a config the compiler rejects
            print(f"{plan.name():32s} failed: {str(e).splitlines()[0][:160]}", flush=True)


if __name__ == "__main__":
    main()
