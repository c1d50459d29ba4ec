"""W4A16 (autotuned Triton) vs fp16 cuBLAS vs tinygemm (torch._weight_int4pack_mm) vs LMDeploy's AWQ Triton kernel on
Llama-class linear shapes.

    python3 benchmarks/kernels.py [--shapes 4096x4096,11008x4096] [--ms 1,16,64] [--group 128] [--peers .peers]

LMDeploy's kernel (`lmdeploy/pytorch/kernels/cuda/awq_kernels.py` of LMDeploy 0.18, the PyTorch engine's W4A16 path)
is loaded from its wheel in `--peers`/lmdeploy-pt-0.18/wheels (that one file imports only torch and triton, so
nothing is installed) and fed the same quantized weight in AutoAWQ's gemm layout; its output is checked first.

Timing: each op runs CALLS times inside one CUDA graph over CALLS different weight copies (so the weights are never
served from the 60 MB L2); the graph replays REPS times between CUDA events; the median replay over CALLS is the time
per call. Launch gaps inside a graph are what the engine sees too. Bandwidth counts the bytes one call must move:
weights (+ scales, zeros), x and y. Writes everything to $OUT/kernels.json (or ./kernels.json), prints a table last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmd.turbomind.kernels import w4a16_mma_gemm, w4a16_wgmma  # noqa: E402
from lmd.turbomind.kernels.gpu_timing import graph_ms  # noqa: E402
from lmd.turbomind.kernels.w4a16 import TUNE_LOG, plan_for, plan_key, run_plan  # noqa: E402
from lmd.turbomind.kernels.w4a16_layout import dequantize, engine_to_awq, quantize_to_engine  # noqa: E402
from lmd.turbomind.kernels.w4a16_mma_gemv import launch_shape  # noqa: E402

AWQ_KERNELS = "lmdeploy/pytorch/kernels/cuda/awq_kernels.py"

SHAPES = "4096x4096,11008x4096,4096x11008,12288x4096,14336x4096,4096x14336"  # N (out) x K (in)
MS = "1,2,4,8,16,32,64,128,256,1024"
REPS = 30


def copies_for(bytes_one: int) -> int:
    """Enough weight copies that one graph replay streams well past the L2 (at least 256 MB), at most 64."""
    return max(4, min(64, -(-256 * 2**20 // bytes_one)))


def graph_time_us(fns: list, reps: int = REPS) -> float:
    """Median per-call time (µs) of running every fn in order, captured as one CUDA graph."""
    return graph_ms(fns, reps) * 1000.0


def tinygemm_pack(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RTN int4 of W [N, K] for torch._weight_int4pack_mm: w = (q - 8) * scale + zero, bf16 scale/zero [K/g, N, 2]."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    wmax, wmin = wg.amax(-1), wg.amin(-1)
    scale = (wmax - wmin).clamp(min=1e-5) / 15
    q = torch.clamp(torch.round((wg - wmin[..., None]) / scale[..., None]), 0, 15).to(torch.int32).reshape(n, k)
    zero = wmin + 8 * scale
    packed_u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    packed = torch._convert_weight_to_int4pack(packed_u8, 8)
    sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, sz


def load_lmdeploy_awq(peers: Path, log: list) -> ModuleType | None:
    """LMDeploy 0.18's AWQ kernel module, read out of its wheel; None (and a log line) when it is not there."""
    wheels = sorted((peers / "lmdeploy-pt-0.18" / "wheels").glob("lmdeploy-*.whl"))
    if not wheels:
        log.append(f"LMDeploy AWQ kernel: no lmdeploy wheel in {peers}/lmdeploy-pt-0.18/wheels")
        return None
    folder = Path(tempfile.mkdtemp(prefix="lmdeploy-awq-"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        path = Path(wheel.extract(AWQ_KERNELS, folder))
    spec = importlib.util.spec_from_file_location("lmdeploy_awq_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def programs(plan, m: int, n: int, k: int, group: int) -> int:
    """Programs (CTAs) the plan launches; over the SM count that is the number of waves if one program fits per SM."""
    name = type(plan).__name__
    if name == "MmaGemvConfig":
        tiles, blocks, split = launch_shape(plan, m, n, k, group)
        return tiles * blocks * split
    if name == "MmaGemmConfig":
        tiles, blocks, split = w4a16_mma_gemm.launch_shape(plan, m, n, k)[0]
        return tiles * blocks * split
    if name == "WgmmaConfig":
        return w4a16_wgmma.grid_size(plan, m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    if name == "GemvConfig":
        return -(-n // plan.block_n) * plan.split_k
    if name in ("GemmConfig", "WtGemmConfig"):
        return -(-m // plan.block_m) * -(-n // plan.block_n) * plan.split_k
    return -(-k // (8 * plan.block_k8)) * -(-n // plan.block_n)  # the dequant kernel (cuBLAS not counted)


def copy_bandwidth() -> float:
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = graph_time_us([lambda: b.copy_(a)], reps=10)
    return 2 * a.numel() / (t * 1e-6) / 1e12


def bench_shape(n: int, k: int, ms: list[int], group: int, log: list, awq: ModuleType | None = None) -> list[dict]:
    dev = torch.device("cuda")
    w = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
    qw, s, z = quantize_to_engine(w, group, torch.float16)
    q_bytes = qw.numel() * 4 + 2 * s.numel() * 2
    copies = copies_for(q_bytes)
    fp16_w = [w.clone() for _ in range(max(4, min(copies, -(-256 * 2**20 // (n * k * 2)))))]
    quant = [(qw.clone(), s.clone(), z.clone()) for _ in range(copies)]
    tg = tinygemm_pack(w, group)
    tiny = [(tg[0].clone(), tg[1].clone()) for _ in range(copies)]
    if awq is None:
        lmdeploy = []
    else:  # awq_linear(x, qweight, scales, qzeros)
        aw, az, asc = engine_to_awq(qw, s, z)
        lmdeploy = [(aw.clone(), asc.clone(), az.clone()) for _ in range(copies)]
    reference = None if awq is None else dequantize(qw, s, z).float()  # [K, N]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        xb = x.to(torch.bfloat16)
        chosen = plan_for(m, qw, s, z, torch.float16)  # tunes this (bucket, N, K, group) once, then cached
        timings = TUNE_LOG.get(plan_key(m, qw, s, torch.float16), [])
        t_fp16 = graph_time_us([lambda wi=wi, x=x: F.linear(x, wi) for wi in fp16_w])
        t_w4 = graph_time_us([lambda p=p, x=x, c=chosen: run_plan(c, x, *p) for p in quant])
        try:
            t_tiny = graph_time_us([lambda p=p, xb=xb: torch._weight_int4pack_mm(xb, p[0], group, p[1])
                                    for p in tiny])
        except RuntimeError as e:
            t_tiny = float("nan")
            log.append(f"tinygemm failed n={n} k={k} m={m}: {e}")
        t_lmdeploy = float("nan")
        if lmdeploy:
            try:
                got = awq.awq_linear(x, *lmdeploy[0]).float()
                ref = x.float() @ reference
                error = ((got - ref).abs().max() / ref.abs().max()).item()
                if error > 1e-2:
                    raise RuntimeError(f"relative error {error:.3g} against the dequantized weight")
                t_lmdeploy = graph_time_us([lambda p=p, x=x: awq.awq_linear(x, *p) for p in lmdeploy])
            except Exception as e:  # noqa: BLE001 (the peer's kernel may refuse a shape: recorded, the run goes on)
                log.append(f"LMDeploy AWQ kernel failed n={n} k={k} m={m}: {type(e).__name__}: {e}")
        moved = q_bytes + 2 * m * (k + n)
        row = dict(n=n, k=k, m=m, group=group, plan=chosen.name(), fp16_us=t_fp16, tinygemm_us=t_tiny, w4a16_us=t_w4,
                   lmdeploy_awq_us=t_lmdeploy, vs_lmdeploy=t_lmdeploy / t_w4,
                   vs_fp16=t_fp16 / t_w4, vs_tinygemm=t_tiny / t_w4, w4a16_tb_s=moved / (t_w4 * 1e-6) / 1e12,
                   fp16_tb_s=(n * k * 2 + 2 * m * (k + n)) / (t_fp16 * 1e-6) / 1e12,
                   w4a16_tflops=2 * m * n * k / (t_w4 * 1e-6) / 1e12, programs=programs(chosen, m, n, k, group),
                   tune=timings)
        rows.append(row)
        print(f"{n}x{k} m={m:5d} fp16 {t_fp16:8.1f}us tiny {t_tiny:8.1f}us lmdeploy {t_lmdeploy:8.1f}us w4a16 "
              f"{t_w4:8.1f}us x{row['vs_fp16']:.2f} vs fp16, x{row['vs_tinygemm']:.2f} vs tiny, "
              f"x{row['vs_lmdeploy']:.2f} vs lmdeploy, {row['w4a16_tb_s']:.2f} TB/s "
              f"{row['programs']} CTAs "
              f"[{chosen.name()}]", flush=True)
        best_per_family: dict[str, tuple[str, float]] = {}
        for name, t in sorted(timings, key=lambda t: t[1]):
            best_per_family.setdefault(name.split(" ")[0], (name, t))
        print("    best per kernel: " + ", ".join(f"{name} {t * 1000:.1f}us" for name, t in best_per_family.values()),
              flush=True)
    return rows


def main() -> None:
    os.environ.setdefault("LMD_W4A16_PLAN_CACHE", "0")  # always tune here: the tuning log is part of the results
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=SHAPES, help="comma list of NxK (N out, K in)")
    parser.add_argument("--ms", default=MS, help="comma list of token counts M")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--peers", default=".peers", help="folder holding lmdeploy-pt-0.18/ (a copy of ../shared/peers)")
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, copy {bw:.2f} TB/s", flush=True)
    log: list[str] = []
    rows = []
    awq = load_lmdeploy_awq(Path(args.peers), log)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        rows += bench_shape(n, k, [int(v) for v in args.ms.split(",")], args.group, log, awq)
    out = Path(os.environ.get("OUT", "."), "kernels.json")
    out.write_text(json.dumps(dict(gpu=props.name, copy_tb_s=bw, torch=torch.__version__, rows=rows, log=log), indent=1))
    print("\n".join(log))
    print(f"\nW4A16 g{args.group} speed-up over fp16 cuBLAS (over tinygemm / over LMDeploy's AWQ kernel), {props.name}, "
          f"copy {bw:.2f} TB/s")
    ms = sorted({r["m"] for r in rows})
    print("N x K".ljust(12) + "".join(f"{'M=' + str(m):>18s}" for m in ms))
    for shape in dict.fromkeys((r["n"], r["k"]) for r in rows):
        cells = {r["m"]: r for r in rows if (r["n"], r["k"]) == shape}
        print(f"{shape[0]}x{shape[1]}".ljust(12) + "".join(
            f"{cells[m]['vs_fp16']:6.2f}({cells[m]['vs_tinygemm']:4.1f}/{cells[m]['vs_lmdeploy']:4.1f})" for m in ms))


if __name__ == "__main__":
    main()
