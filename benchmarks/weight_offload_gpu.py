"""Weight offload on one GPU: decode speed, KV blocks and greedy tokens with 0, some and all decoder layers' linear
weights in pinned host memory (issue 20, deliverable 3). A CUDA machine.

    python3 benchmarks/weight_offload_gpu.py [--offload-gb 0,3.2,13] [--batch-sizes 1,16] [--new-tokens 32]

A random Llama-2-7B-shaped fp16 workspace (benchmarks/engine.py's builder); per setting a fresh engine (CUDA graphs
on: the copies are captured), `batch` random 64-token prompts decoded greedily, EOS ignored; decode ms per token =
(wall time of the batch - time to its first token) / (new tokens - 1), on the engine thread. Tokens are compared with
the no-offload engine's. Writes $OUT/weight_offload_gpu.json and prints a table last.
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
from engine import LLAMA2_7B, build_workspace  # noqa: E402

from lmd.turbomind.engine import Engine  # noqa: E402
from lmd.turbomind.gen_config import GenerationConfig  # noqa: E402


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
               decode_ms=(wall - (first - start)) / (new_tokens - 1) * 1000,
               graphs=engine.runner.graphs is not None and engine.runner.graphs.capture)
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return row, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--offload-gb", default="0,3.2,13")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    ws = build_workspace(Path(tempfile.mkdtemp()) / "ws", LLAMA2_7B, int4=False, session_len=1024,
                         device=torch.device("cuda"))
    rows, reference = [], {}
    for gb in (float(v) for v in args.offload_gb.split(",")):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            row, tokens = run(ws, gb, batch, args.new_tokens)
            reference.setdefault(batch, tokens)
            row["tokens_equal_no_offload"] = tokens == reference[batch]
            rows.append(row)
            print(row, flush=True)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_offload_gpu.json").write_text(json.dumps(rows, indent=1))
    print("\noffload GiB  layers  batch  KV blocks  decode ms/token  graphs  tokens = no offload")
    for r in rows:
        print(f"{r['offloaded_gib']:>11.2f}  {r['offloaded_layers']:>6}  {r['batch']:>5}  {r['kv_blocks']:>9}  "
              f"{r['decode_ms']:>15.2f}  {r['graphs']!s:>6}  {r['tokens_equal_no_offload']}")


if __name__ == "__main__":
    main()
