"""Weight offload on one GPU: a model larger than the memory the process may use, served with some decoder layers'
linear weights in pinned host memory (issue 20, deliverable 3). A CUDA machine.

    python3 benchmarks/weight_offload_gpu.py [--shape llama2-13b] [--memory-gb 16] [--offload-gb 12,20]
        [--batch-sizes 1,16] [--new-tokens 32]

A random-weight fp16 workspace of the shape (benchmarks/engine.py's builder; Llama-2-13B: 26 GB). First a reference
engine with no offload and no memory cap (greedy tokens and decode speed of the whole model on the GPU); then
`torch.cuda.set_per_process_memory_fraction` caps the process at --memory-gb and each --offload-gb setting serves the
same prompts (CUDA graphs on: the copies are captured). Per row: `batch` random 64-token prompts decoded greedily,
EOS ignored; decode ms per token = (wall time of the batch - time to its first token) / (new tokens - 1), on the
engine thread; KV blocks the pool got; tokens compared with the reference engine's. The bound: every decode step must
bring each offloaded layer's weights across PCIe, so a step takes at least hosted bytes / host-to-device bandwidth,
measured in the same run (pinned 1 GiB copies, CUDA events). Writes $OUT/weight_offload_gpu.json, prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import LLAMA2_7B, SHAPE_KEYS, build_workspace  # noqa: E402

from lmd.turbomind.engine import Engine  # noqa: E402
from lmd.turbomind.gen_config import GenerationConfig  # noqa: E402

LLAMA2_13B = dict(zip(SHAPE_KEYS, (5120, 13824, 40, 40, 40), strict=True), vocab_size=32000)
SHAPES = {"llama2-7b": LLAMA2_7B, "llama2-13b": LLAMA2_13B}


def h2d_gb_per_s(reps: int = 5) -> float:
    """Pinned host -> device copy bandwidth (GB/s), the median of `reps` 1 GiB copies."""
    src = torch.empty(2**30, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    return 2**30 / sorted(times[1:])[reps // 2] / 1e9


def run(ws: Path, gb: float, batch: int, new_tokens: int) -> tuple[dict, list[list[int]]]:
    engine = Engine(ws, offload_weights_gb=gb, max_batch_size=max(16, batch))
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 32000, (64,), generator=g).tolist() for _ in range(batch)]
    config = GenerationConfig(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts[0], GenerationConfig(max_new_tokens=4, temperature=0)).result()  # warm-up
    start = time.perf_counter()
    streams = [engine.generate(p, config) for p in prompts]
    first = None
    tokens = []
    for s in streams:
        ids = []
        for delta in s:
            if first is None and delta.token_ids:
                first = time.perf_counter()
            ids += delta.token_ids
        tokens.append(ids)
    wall = time.perf_counter() - start
    plan = engine.runner.offload_plan
    row = dict(offload_gb=gb, batch=batch, offloaded_layers=0 if plan is None else len(plan.layers),
               offloaded_gib=0 if plan is None else plan.bytes / 2**30, kv_blocks=engine.stats().blocks_total,
               hosted_bytes=0 if plan is None else plan.bytes,
               peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
               decode_ms=(wall - (first - start)) / (new_tokens - 1) * 1000,
               graphs=engine.runner.graphs is not None and engine.runner.graphs.capture)
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return row, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama2-13b", choices=sorted(SHAPES))
    p.add_argument("--memory-gb", type=float, default=16.0, help="GiB the process may use with offload on")
    p.add_argument("--offload-gb", default="12,20", help="GiB of layer weights to free per setting")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    t0 = time.perf_counter()
    ws = build_workspace(Path(tempfile.mkdtemp()) / "ws", SHAPES[args.shape], int4=False, session_len=1024,
                         device=torch.device("cuda"))
    print(f"workspace built in {time.perf_counter() - t0:.0f} s", flush=True)
    bandwidth = h2d_gb_per_s()
    print(f"host-to-device {bandwidth:.1f} GB/s", flush=True)
    rows, reference = [], {}
    settings = [(0.0, None)] + [(float(v), args.memory_gb) for v in args.offload_gb.split(",")]
    for gb, cap in settings:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if cap is None else min(1.0, cap * 2**30 / total))
        for batch in batches:
            torch.cuda.reset_peak_memory_stats()
            try:
                row, tokens = run(ws, gb, batch, args.new_tokens)
            except Exception as e:  # noqa: BLE001 - a setting that does not fit is a row, the run goes on
                print(f"offload {gb} GiB, cap {cap}, batch {batch}: {type(e).__name__}: {e}", flush=True)
                gc.collect()
                torch.cuda.empty_cache()
                continue
            reference.setdefault(batch, tokens)
            bound_ms = row["hosted_bytes"] / (bandwidth * 1e9) * 1000
            row.update(cap_gib=cap, h2d_gb_s=bandwidth, bound_ms=bound_ms,
                       tokens_equal_reference=tokens == reference[batch], tok_s=batch * 1000 / row["decode_ms"])
            rows.append(row)
            print(row, flush=True)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_offload_gpu.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{args.shape}, host-to-device {bandwidth:.1f} GB/s")
    print("cap GiB  offload GiB  layers  batch  KV blocks  peak GiB  ms/token  tok/s  bound ms  bound/ms  graphs  "
          "tokens = ref")
    for r in rows:
        cap = "none" if r["cap_gib"] is None else f"{r['cap_gib']:.0f}"
        share = r["bound_ms"] / r["decode_ms"] if r["bound_ms"] else float("nan")
        print(f"{cap:>7}  {r['offloaded_gib']:>11.2f}  {r['offloaded_layers']:>6}  {r['batch']:>5}  "
              f"{r['kv_blocks']:>9}  {r['peak_reserved_gib']:>8.1f}  {r['decode_ms']:>8.2f}  {r['tok_s']:>5.1f}  "
              f"{r['bound_ms']:>8.2f}  {share:>8.2f}  {r['graphs']!s:>6}  {r['tokens_equal_reference']}")


if __name__ == "__main__":
    main()
