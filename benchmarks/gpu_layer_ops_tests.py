"""The Triton layer ops on a GPU at Llama-2-7B shapes: residual add + RMSNorm, SiLU * up, RoPE + KV write, each
against its PyTorch reference (fp16 and bf16: the CPU interpreter in CI computes bf16 wrongly), and their time
against the reference's (CUDA graphs of 20 calls, median of 20 replays, warmed up on a side stream).

    python3 benchmarks/gpu_layer_ops_tests.py

Error is max |kernel - reference| / max |reference| (one rounding step of the dtype: 2^-11 fp16, 2^-8 bf16; the
residual sum must be identical). Writes $OUT/gpu_layer_ops_tests.json when OUT is set; prints a table last; exits 1
on a failure.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import graph_time_us  # noqa: E402
from lmd.turbomind.kernels.head_rms_norm import qk_rms_norm_triton  # noqa: E402
from lmd.turbomind.kernels.rms_norm import add_rms_norm_triton  # noqa: E402
from lmd.turbomind.kernels.rotary import rotary_qkv_triton  # noqa: E402
from lmd.turbomind.kernels.silu_mul import silu_mul_triton  # noqa: E402
from lmd.turbomind.kv_cache import KVCache  # noqa: E402
from lmd.turbomind.layers import add_rms_norm_reference, qk_rms_norm_reference, silu_mul_reference  # noqa: E402
from lmd.turbomind.rope import rotary_qkv_reference  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 11008, 32, 32, 128
TOL = {torch.float16: 2 * 2**-11, torch.bfloat16: 2 * 2**-8}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def graph_us(fn, calls: int = 20) -> float:
    """Median µs of one call, `calls` of them captured in one CUDA graph (kernels.py's timing)."""
    return graph_time_us([fn] * calls, reps=20)


def cases(t: int, dtype: torch.dtype, dev: torch.device) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(t)
    out = []
    h = torch.randn(t, HIDDEN, device=dev, generator=g).to(dtype)
    delta = torch.randn(t, HIDDEN, device=dev, generator=g).to(dtype)
    w = (torch.rand(HIDDEN, device=dev, generator=g) + 0.5).to(dtype)
    total, normed = add_rms_norm_triton(h, delta, w, 1e-5)
    ref_total, ref_normed = add_rms_norm_reference(h, delta, w, 1e-5)
    out.append(dict(op="add+rmsnorm", err=rel(normed, ref_normed), sum_err=rel(total, ref_total),
                    kernel_us=graph_us(lambda: add_rms_norm_triton(h, delta, w, 1e-5)),
                    reference_us=graph_us(lambda: add_rms_norm_reference(h, delta, w, 1e-5))))
    gu = (torch.randn(t, 2 * INTER, device=dev, generator=g) * 3).to(dtype)
    out.append(dict(op="silu*up", err=rel(silu_mul_triton(gu), silu_mul_reference(gu)), sum_err=0.0,
                    kernel_us=graph_us(lambda: silu_mul_triton(gu)),
                    reference_us=graph_us(lambda: silu_mul_reference(gu))))
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, generator=g).to(dtype)
    qk_w = (torch.rand(2, HEAD_DIM, device=dev, generator=g) + 0.5).to(dtype)
    normed_qkv = qk_rms_norm_triton(qkv.clone(), qk_w, HEADS, KV_HEADS, HEAD_DIM, 1e-6)
    out.append(dict(op="q/k head rmsnorm", err=rel(normed_qkv, qk_rms_norm_reference(qkv.clone(), qk_w, HEADS,
                                                                                      KV_HEADS, HEAD_DIM, 1e-6)),
                    sum_err=0.0, kernel_us=graph_us(lambda: qk_rms_norm_triton(normed_qkv, qk_w, HEADS, KV_HEADS,
                                                                               HEAD_DIM, 1e-6)),
                    reference_us=graph_us(lambda: qk_rms_norm_reference(normed_qkv, qk_w, HEADS, KV_HEADS,
                                                                        HEAD_DIM, 1e-6))))
    angles = torch.rand(t, HEAD_DIM // 2, device=dev, generator=g) * 100
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    cache = KVCache(1, -(-t // 64) + 1, 64, KV_HEADS, HEAD_DIM, dtype, dev)
    slots = torch.randperm(cache.num_blocks * 64, device=dev)[:t]

    def reference():
        q, k, v = rotary_qkv_reference(qkv, cos, sin, HEADS, KV_HEADS, HEAD_DIM)
        cache.write(0, k, v, slots)
        return q

    q_ref = reference()
    k_ref, v_ref = (x[slots].clone() for x in cache.float_slots(0))
    for x in cache.float_slots(0):  # the kernel must write every slot of the batch and nothing else
        x.fill_(float("nan"))
    q = rotary_qkv_triton(qkv, cos, sin, HEADS, KV_HEADS, HEAD_DIM, *cache.float_slots(0), slots)[0]
    k_out, v_out = (x[slots] for x in cache.float_slots(0))
    others = torch.ones(cache.num_blocks * 64, dtype=torch.bool, device=dev)
    others[slots] = False
    untouched = all(bool(x[others].isnan().all()) for x in cache.float_slots(0))
    err = max(rel(q, q_ref), rel(k_out, k_ref), rel(v_out, v_ref)) if untouched else float("inf")
    out.append(dict(op="rope+kv write", err=err, sum_err=0.0,
                    kernel_us=graph_us(lambda: rotary_qkv_triton(qkv, cos, sin, HEADS, KV_HEADS, HEAD_DIM,
                                                                 *cache.float_slots(0), slots)),
                    reference_us=graph_us(reference)))
    return out


def far_slots_case(dev: torch.device) -> dict:
    """K/V stored at slots whose element offsets pass 2^31 (a large pool): int64 addressing in the kernel."""
    dtype, t = torch.float16, 4
    per_slot = KV_HEADS * HEAD_DIM
    num_slots = (2**31) // per_slot + 1024
    k_cache = torch.full((num_slots, KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype, device=dev)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.arange(num_slots - t, num_slots, device=dev)
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev).to(dtype)
    cos, sin = torch.ones(t, HEAD_DIM, device=dev, dtype=dtype), torch.zeros(t, HEAD_DIM, device=dev, dtype=dtype)
    rotary_qkv_triton(qkv, cos, sin, HEADS, KV_HEADS, HEAD_DIM, k_cache, v_cache, slots)
    k_want = qkv[:, HEADS * HEAD_DIM: (HEADS + KV_HEADS) * HEAD_DIM].reshape(t, KV_HEADS, HEAD_DIM)
    v_want = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].reshape(t, KV_HEADS, HEAD_DIM)
    err = max(rel(k_cache[slots], k_want), rel(v_cache[slots], v_want))  # cos 1, sin 0: k unchanged
    del k_cache, v_cache
    torch.cuda.empty_cache()
    return dict(op="kv write > 2^31", err=err, sum_err=0.0, kernel_us=0.0, reference_us=0.0, dtype="float16",
                tokens=t, ok=err == 0.0)


def main() -> int:
    dev = torch.device("cuda")
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for t in (1, 16, 2048):
            for r in cases(t, dtype, dev):
                ok = r["err"] <= TOL[dtype] and r["sum_err"] == 0.0
                rows.append(dict(r, dtype=str(dtype).removeprefix("torch."), tokens=t, ok=ok))
    rows.append(far_slots_case(dev))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_layer_ops_tests.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{torch.cuda.get_device_name()}, Llama-2-7B shapes (hidden {HIDDEN}, inter {INTER}, {HEADS}x{HEAD_DIM})")
    print(f"{'op':14} {'dtype':9} {'tokens':>6} {'rel err':>9} {'kernel us':>10} {'reference us':>13} {'speed-up':>9}")
    for r in rows:
        speed = f"{r['reference_us'] / r['kernel_us']:8.1f}x" if r["kernel_us"] else f"{'-':>9}"
        print(f"{r['op']:14} {r['dtype']:9} {r['tokens']:6d} {r['err']:9.2e} {r['kernel_us']:10.1f} "
              f"{r['reference_us']:13.1f} {speed}{'' if r['ok'] else '  FAIL'}")
    failures = sum(not r["ok"] for r in rows)
    print(f"{len(rows)} checks, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
