"""W8A8 on one GPU: correctness of lmd's Triton kernels (fp16 / bf16) against the PyTorch references, then GEMM speed
on Llama-7B's linear shapes against fp16 cuBLAS and torch's own 8-bit GEMMs.

    python benchmarks/w8a8_gpu.py [--json-out FILE] [--no-sweep] [--m 1,16,64,256,1024]

Timed per call with cold weights (lmd.turbomind.kernels.gpu_timing.cold_call_ms: L2 flushed, launch overhead hidden),
median of 15. Rows per (shape, M):

    fp16            torch.matmul, fp16 x [M, K] @ W.T (cuBLAS)
    int8 / fp8      lmd's Triton scaled GEMM alone (codes already quantized), tiles of `tiles_for(M)`
    *_best          the best of a small tile sweep (and which tiles), to retune `tiles_for`
    *_linear        lmd's whole W8A8 linear: per-token quantization kernel + Triton GEMM (tiles_for(M))
    *_planned_gemm  the GEMM the engine's W8A8Linear planned for M's bucket (w8a8_plan: Triton tiles or torch's),
                    codes already quantized; *_plan names it
    *_planned       the engine's whole W8A8Linear: quantization + the planned GEMM
    scaled_mm       torch._scaled_mm FP8, row-wise scales, bf16 out (cuBLASLt)
    int_mm          torch._int_mm int8 -> int32 (cuBLAS), scales not applied (its lower bound)

Speedups are fp16 time / row time. The issue's goals (H200): FP8 >= 1.6x fp16 at M >= 256 and >= torch._scaled_mm;
int8 >= 1.5x fp16 at M >= 256. Any case that fails prints its error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmd.turbomind.kernels.gpu_timing import cold_call_ms  # noqa: E402
from lmd.turbomind.kernels.w8a8_gemm import Tiles, scaled_mm_triton, tiles_for  # noqa: E402
from lmd.turbomind.kernels.w8a8_plan import bucket_of, run_plan  # noqa: E402
from lmd.turbomind.kernels.w8a8_quant import quantize_per_token_triton  # noqa: E402
from lmd.turbomind.kernels.w8a8_reference import (  # noqa: E402
    quantize_per_token_reference,
    quantize_weight_per_channel,
    scaled_mm_reference,
)
from lmd.turbomind.linear import W8A8Linear, w8a8_linear  # noqa: E402

LLAMA_7B = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}  # (N, K)
QDTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SWEEP = [Tiles(16, 64, 256, 4, 4), Tiles(16, 128, 128, 4, 4), Tiles(32, 64, 256, 4, 4), Tiles(32, 128, 128, 4, 4),
         Tiles(64, 64, 128, 4, 4), Tiles(64, 128, 128, 4, 4), Tiles(64, 256, 128, 8, 3), Tiles(128, 128, 64, 4, 4),
         Tiles(128, 128, 128, 8, 3), Tiles(128, 256, 64, 8, 3), Tiles(128, 256, 128, 8, 3), Tiles(256, 128, 64, 8, 3)]


def correctness() -> dict[str, object]:
    out: dict[str, object] = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for act in (torch.float16, torch.bfloat16):
        for name, qdtype in QDTYPES.items():
            key = f"{name}-{str(act).removeprefix('torch.')}"
            try:
                x = torch.randn(300, 4096, device="cuda", generator=g).to(act)
                x[5, 17] = 80.0
                w = torch.randn(1024, 4096, device="cuda", generator=g) * 0.02
                wq, ws = quantize_weight_per_channel(w, qdtype)
                codes, scales = quantize_per_token_triton(x, qdtype)
                ref_codes, ref_scales = quantize_per_token_reference(x, qdtype)
                diff = codes.float() != ref_codes.float()
                y = scaled_mm_triton(codes, scales, wq, ws, None, act)
                y_ref = scaled_mm_reference(codes, scales, wq, ws, None, act)
                dense = x.float() @ w.t()
                full = w8a8_linear(x, wq, ws)
                out[key] = {"code_mismatch": diff.float().mean().item(),
                            "scale_max_rel_diff": ((scales - ref_scales).abs() / ref_scales).max().item(),
                            "gemm_rel_err_vs_reference": _rel(y, y_ref),
                            "linear_rel_err_vs_float_matmul": _rel(full, dense)}
            except Exception:  # noqa: BLE001 - report and go on
                out[key] = traceback.format_exc(limit=3)
    return out


def speed(ms: list[int], sweep: bool) -> list[dict[str, object]]:
    flush = torch.empty(512 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    rows = []
    for shape, (n, k) in LLAMA_7B.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        w16 = w.half()
        quantized = {name: quantize_weight_per_channel(w, q) for name, q in QDTYPES.items()}
        planned = {name: W8A8Linear(wq, ws, dtype=torch.float16) for name, (wq, ws) in quantized.items()}
        for m in ms:
            x = torch.randn(m, k, device="cuda").half()
            row: dict[str, object] = {"shape": shape, "M": m, "N": n, "K": k}
            row["fp16"] = _time(lambda x=x, w16=w16: x @ w16.t(), flush)
            for name, (wq, ws) in quantized.items():
                codes, scales = quantize_per_token_triton(x, wq.dtype)
                row[name] = _time(lambda c=codes, s=scales, wq=wq, ws=ws: scaled_mm_triton(c, s, wq, ws, None,
                                                                                          torch.float16), flush)
                row[f"{name}_linear"] = _time(lambda x=x, wq=wq, ws=ws: w8a8_linear(x, wq, ws), flush)
                layer = planned[name]
                plan = layer.plans.get(bucket_of(m))
                row[f"{name}_plan"] = repr(plan)
                if plan is not None:
                    row[f"{name}_planned_gemm"] = _time(lambda c=codes, s=scales, wq=wq, ws=ws, p=plan: run_plan(
                        p, c, s, wq, ws, None, torch.float16), flush)
                row[f"{name}_planned"] = _time(lambda x=x, layer=layer: layer(x), flush)
                if sweep:
                    best = min(((_time(lambda c=codes, s=scales, wq=wq, ws=ws, t=t: scaled_mm_triton(
                        c, s, wq, ws, None, torch.float16, t), flush), t) for t in SWEEP
                        if t.block_m <= max(16, 2 * m)), key=lambda r: r[0] if isinstance(r[0], float) else 1e9)
                    row[f"{name}_best"], row[f"{name}_best_tiles"] = best[0], vars(best[1])
                if name == "fp8":
                    row["scaled_mm"] = _time(lambda c=codes, s=scales, wq=wq, ws=ws: torch._scaled_mm(
                        c, wq.t(), scale_a=s[:, None], scale_b=ws[None, :], out_dtype=torch.bfloat16), flush)
                else:
                    row["int_mm"] = _time(lambda c=codes, wq=wq: torch._int_mm(c, wq.t()), flush) if m > 16 \
                        else "needs M > 16"
            row["tiles_for"] = vars(tiles_for(m))
            rows.append(row)
            _print_row(row)
    return rows


def _time(fn, flush) -> float | str:
    try:
        return round(cold_call_ms(fn, flush), 4)
    except Exception as exc:  # noqa: BLE001 - an unsupported configuration is a result, not a crash
        return f"error: {str(exc).splitlines()[0][:160]}"


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _print_row(row: dict[str, object]) -> None:
    base = row["fp16"]
    parts = [f"{row['shape']:>8} M={row['M']:<5} fp16 {base} ms"]
    for key in ("int8", "int8_best", "int8_linear", "int8_planned_gemm", "int8_planned", "int_mm", "fp8", "fp8_best",
                "fp8_linear", "fp8_planned_gemm", "fp8_planned", "scaled_mm"):
        value = row.get(key)
        if isinstance(value, float) and isinstance(base, float):
            parts.append(f"{key} {value} ms ({base / value:.2f}x)")
        elif value is not None:
            parts.append(f"{key} {value}")
    print(" | ".join(parts), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--m", default="1,16,64,256,1024")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("w8a8_gpu.py needs a CUDA GPU")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "correctness": correctness()}
    print(json.dumps(result["correctness"], indent=1), flush=True)
    result["speed"] = speed([int(v) for v in args.m.split(",")], not args.no_sweep)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
