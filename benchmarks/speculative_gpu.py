"""Cost of a speculative verification step vs a plain decode step, random Llama-2-7B-shaped workspace (a GPU).

    python3 benchmarks/speculative_gpu.py [--weights fp16,int4] [--batch-sizes 1,16] [--chunks 4,8,16,32]
        [--context 512] [--iters 50] [--accepted-length 2.6] [--eager]
    python3 benchmarks/speculative_gpu.py --tiny      # a tiny model on CPU: runs every step of the script

Workspaces are written as benchmarks/engine.py writes them (random fp16 / AWQ-int4 weights, lmd's deploy writer).
Each of B sequences holds `context` tokens of KV; then, through the engine's own runner (`ModelRunner.run`), one step
computes per sequence either 1 token (plain decode: its decode CUDA graph) or 1 + K tokens with logits at every
position (a verification of K proposals, `ScheduledChunk.num_draft`), followed by the argmax of every logits row.
Verifications replay the graphs of T = 1 + K tokens per sequence that a speculative engine captures at start
(`ModelRunner.enable_verify_graphs`, here once per K: `capture_s` and `graph_mib` are what each K adds);
`--eager` leaves them out, so verifications run eagerly as before issue 17. On CPU (--tiny) the graphs' static
buffers run eagerly. K in --chunks: 4 and 8 are the chains; 16 and 32 stand for the trees' token counts (the same
forward with a causal mask: this is the chain cost of that many tokens). Medians of CUDA-event times.
`--accepted-length`: tokens made per verification (measured on CPU, docs/benchmarks.md) -> the implied decode
speed-up L / cost ratio. Per K, `graph_vs_eager`: the largest logit difference, as a fraction of the logits' range,
between a padded mixed step (K, K // 2 and 0 proposals: bucket 4) through the graphs and the same step run eagerly.
Writes $OUT/speculative_gpu.json (or ./) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLAMA2_7B, TINY, build_workspace, prewarm_int4  # noqa: E402

from lmd.turbomind.engine import Engine  # noqa: E402
from lmd.turbomind.scheduler import ScheduledChunk, SchedulerOutput  # noqa: E402


def step_ms(engine: Engine, tables: list[list[int]], context: int, k: int, iters: int, device: torch.device) -> float:
    """Median time of one step in which every sequence computes 1 + k tokens after `context` (k = 0: plain decode)."""
    chunks = tuple(ScheduledChunk(i, tuple(range(7, 8 + k)), context, tuple(table), True, num_draft=k)
                   for i, table in enumerate(tables))
    output = SchedulerOutput(chunks, ())
    times = []
    for i in range(iters + 3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            engine.runner.run(output).argmax(dim=-1)
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t = time.perf_counter()
            engine.runner.run(output).argmax(dim=-1)
            elapsed = 1000 * (time.perf_counter() - t)
        if i >= 3:  # the first runs: allocator and kernel warm-up
            times.append(elapsed)
    return statistics.median(times)


def add_verify_graphs(engine: Engine, chunks: list[int], device: torch.device) -> dict[int, dict]:
    """Capture the verification graphs of every K; the seconds and device memory each K adds."""
    out = {}
    for k in chunks:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        reserved, t = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0, time.perf_counter()
        engine.runner.enable_verify_graphs(1 + k)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        grown = torch.cuda.memory_reserved(device) - reserved if device.type == "cuda" else 0
        out[k] = dict(capture_s=time.perf_counter() - t, graph_mib=grown / 2**20)
    return out


def graph_vs_eager(engine: Engine, tables: list[list[int]], context: int, k: int) -> float:
    """Largest |graph - eager| logit of a mixed verification step, over the logits' range."""
    drafts = [k, k // 2, 0][: len(tables)]
    chunks = tuple(ScheduledChunk(i, tuple(range(7, 8 + d)), context, tuple(table), True, num_draft=d)
                   for i, (d, table) in enumerate(zip(drafts, tables, strict=False)))
    rows, end = [], 0
    for c in chunks:
        end += len(c.token_ids)
        rows.extend(range(end - 1 - c.num_draft, end))
    eager = engine.runner.run_chunks([(list(c.token_ids), c.start, list(c.block_table)) for c in chunks], rows)
    graph = engine.runner.run(SchedulerOutput(chunks, ()))
    return ((graph - eager).abs().max() / (eager.amax() - eager.amin())).item()


def measure(label: str, ws: Path, args: argparse.Namespace, device: torch.device) -> list[dict]:
    batch_max, k_max = max(args.batch_sizes), max(args.chunks)
    block = 64
    per_seq = -(-(args.context + k_max + 1) // block)
    options = dict(start=False, device=str(device), max_batch_size=batch_max, session_len=args.context + k_max + 64,
                   max_context_token_num=max(batch_max * (k_max + 1), args.context), cache_block_seq_len=block,
                   cache_max_entry_count=batch_max * per_seq)
    rows = []
    with torch.inference_mode(), Engine(ws, **options) as engine:
        if device.type != "cuda":  # --tiny: the graphs' static buffers, run eagerly
            engine.runner.enable_decode_graphs(capture=False)
        added = {} if args.eager else add_verify_graphs(engine, args.chunks, device)
        tables = [engine.block_manager.allocate_blocks(per_seq) for _ in range(batch_max)]
        g = torch.Generator().manual_seed(0)
        vocab = engine.workspace.model.vocab_size
        for table in tables:  # each sequence's context KV
            engine.runner.run_chunks([(torch.randint(3, vocab, (args.context,), generator=g).tolist(), 0, table)], [])
        errors = {k: graph_vs_eager(engine, tables[:3], args.context, k) for k in added}
        for batch in args.batch_sizes:
            plain = step_ms(engine, tables[:batch], args.context, 0, args.iters, device)
            for k in args.chunks:
                verify = step_ms(engine, tables[:batch], args.context, k, args.iters, device)
                ratio = verify / plain
                rows.append(dict(weights=label, batch=batch, proposals=k, plain_ms=plain, verify_ms=verify,
                                 ratio=ratio, implied_speedup=args.accepted_length / ratio,
                                 decode_graphs=engine.runner.graphs is not None,
                                 captured=engine.runner.graphs is not None and engine.runner.graphs.capture,
                                 verify_path="graph" if k in added else "eager",
                                 graph_vs_eager=errors.get(k), **added.get(k, {})))
                print(rows[-1], flush=True)
    return rows


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (script check)")
    p.add_argument("--weights", default="fp16,int4")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--chunks", default="4,8,16,32", help="proposals per verification (K)")
    p.add_argument("--context", type=int, default=512, help="KV tokens per sequence before the step")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--eager", action="store_true", help="verifications run eagerly (no verification graphs)")
    p.add_argument("--accepted-length", type=float, default=2.6,
                   help="tokens per verification to turn the cost ratio into a speed-up")
    args = p.parse_args()
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.chunks = [int(x) for x in args.chunks.split(",")]
    if args.tiny:
        args.iters, args.context, args.batch_sizes = min(args.iters, 3), 64, [1, 2]
    return args


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    shape = TINY if args.tiny else LLAMA2_7B
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmd-spec-gpu-") as tmp:
        for label in args.weights.split(","):
            int4 = label == "int4"
            ws = build_workspace(Path(tmp) / label, shape, int4, args.context + max(args.chunks) + 64, device)
            if int4 and device.type == "cuda":
                prewarm_int4(ws, max(args.batch_sizes) * (max(args.chunks) + 1), device)
            rows += measure(label, ws, args, device)
    out = Path(os.environ.get("OUT", ".")) / "speculative_gpu.json"
    out.write_text(json.dumps(dict(args=vars(args), device=torch.cuda.get_device_name() if device.type == "cuda"
                                   else "cpu", rows=rows), indent=1))
    print(f"\n{'weights':<8}{'batch':>6}{'K':>4}{'verify':>8}{'plain ms':>10}{'verify ms':>11}{'ratio':>7}"
          f"{'speed-up @L=' + str(args.accepted_length):>17}{'vs eager':>10}")
    for r in rows:
        error = "" if r["graph_vs_eager"] is None else f"{r['graph_vs_eager']:.1e}"
        print(f"{r['weights']:<8}{r['batch']:>6}{r['proposals']:>4}{r['verify_path']:>8}{r['plain_ms']:>10.3f}"
              f"{r['verify_ms']:>11.3f}{r['ratio']:>7.2f}{r['implied_speedup']:>16.2f}x{error:>10}")


if __name__ == "__main__":
    main()
