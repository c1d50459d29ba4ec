"""The engine on a GPU with each attention path: do the Triton kernels give the reference path's tokens? (CUDA only)

    python3 benchmarks/gpu_engine_check.py [--prompts 16] [--new-tokens 48]

A random-weight Llama of a small GQA shape (benchmarks/engine.py writes the workspace, fp16 and AWQ int4 g128), the
same random prompts (lengths 16..600, so prefill chunks, decode and a CUDA-graph batch all run) generated greedily
with LMD_ATTENTION=reference and LMD_ATTENTION=triton, one engine after the other. Reports the share of requests whose
tokens are identical, the first differing position otherwise, and the wall time of each run. Writes
$OUT/gpu_engine_check.json when OUT is set. W4A16 runs its untuned default plans (LMD_W4A16_AUTOTUNE=0: this checks
tokens, not speed, and tuning every shape would take minutes). Prints a table last; exits 1 when fewer than 90 % of
requests match (greedy decoding of random weights has near-ties, so a rare late divergence is rounding, not a bug).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import SHAPE_KEYS, build_workspace, prewarm_int4  # noqa: E402

from lmd.turbomind.engine import Engine  # noqa: E402
from lmd.turbomind.gen_config import GenerationConfig  # noqa: E402

SHAPE = dict(zip(SHAPE_KEYS, (1024, 2816, 4, 16, 4), strict=True), vocab_size=4000)  # head_dim 64, GQA 4


def generate_all(ws: Path, attention: str, prompts: list[list[int]], new_tokens: int,
                 device: torch.device) -> tuple[list[list[int]], float]:
    os.environ["LMD_ATTENTION"] = attention
    gen = GenerationConfig(max_new_tokens=new_tokens, top_k=1, ignore_eos=True)
    dtype = "fp16" if device.type == "cuda" else "fp32"
    with Engine(ws, device=str(device), dtype=dtype, max_batch_size=16, session_len=1024) as engine:
        engine.generate(prompts[0][:8], gen, request_id="warm").result()
        start = time.perf_counter()
        streams = [engine.generate(p, gen, request_id=i) for i, p in enumerate(prompts)]
        out = [s.result().token_ids for s in streams]
        return out, time.perf_counter() - start


def main() -> int:
    os.environ.setdefault("LMD_W4A16_AUTOTUNE", "0")
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--device", default="cuda", help="cpu only checks the script (both paths are the reference)")
    args = parser.parse_args()
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 600, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in lengths]
    rows, failures = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for weights in ("fp16", "int4"):
            ws = build_workspace(Path(tmp, weights), SHAPE, weights == "int4", 1024, dev)
            if weights == "int4" and dev.type == "cuda":
                prewarm_int4(ws, 1024, dev)
            ref, t_ref = generate_all(ws, "reference", prompts, args.new_tokens, dev)
            tri, t_tri = generate_all(ws, "triton", prompts, args.new_tokens, dev)
            same = sum(a == b for a, b in zip(ref, tri, strict=True))
            first_diff = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                          for a, b in zip(ref, tri, strict=True)]
            ok = same >= 0.9 * len(prompts)
            failures += not ok
            rows.append(dict(weights=weights, requests=len(prompts), identical=same, ok=ok,
                             first_diff=[d for d in first_diff if d is not None], reference_s=t_ref, triton_s=t_tri))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_engine_check.json").write_text(json.dumps(rows, indent=1))
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"\n{gpu}, {args.prompts} prompts (16..600 tokens) x {args.new_tokens} greedy tokens")
    print(f"{'weights':8} {'identical':>10} {'first diffs':>20} {'reference s':>12} {'triton s':>9}")
    for r in rows:
        print(f"{r['weights']:8} {r['identical']:>4}/{r['requests']:<5} {str(r['first_diff'][:6]):>20} "
              f"{r['reference_s']:12.2f} {r['triton_s']:9.2f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
