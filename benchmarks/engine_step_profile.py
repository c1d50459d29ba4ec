"""Where one decode step of the engine spends its time, host side and GPU side (a CUDA machine).

    python3 benchmarks/engine_step_profile.py [--weights fp16] [--batch-sizes 1,16,64] [--layers 32]

A random-weight Llama-2-7B-shaped workspace (benchmarks/engine.py's writer; int4 plans tuned for M <= 16 first)
runs greedy requests (256 prompt tokens, 64 new) through `Engine.step()` on this thread, with a timer around each
host part of the step (none of them adds a synchronisation): scheduling, the decode graph's input copy (`_fill`), the
replay call, resolving the previous step (its wait for the GPU included), queueing the sampling, and the text
deltas. Then the GPU alone: the last decode step's graph replayed back to back, timed with CUDA events. "exposed
host" = whole step - GPU alone: the time per step the GPU waits for the host (overlap's target: <= 0.1 ms).
Reports medians per decode step. Writes $OUT/engine_step_profile.json; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import LLAMA2_7B, TINY, build_workspace, prewarm_int4  # noqa: E402

from lmd.turbomind.engine import Engine  # noqa: E402
from lmd.turbomind.gen_config import GenerationConfig  # noqa: E402


def timed(timers: dict[str, list[float]], name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        timers[name].append(time.perf_counter() - start)
        return out

    return wrapper


def gpu_alone(engine: Engine, chunks: list, iters: int = 20) -> float:
    """ms per replay of the graph of `chunks`' bucket, back to back (no host work between replays)."""
    graphs = engine.runner.graphs
    b = graphs.bucket(len(chunks))
    graphs._fill(chunks, b)
    graph = graphs.graphs[b][0]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def profile(engine: Engine, batch: int, vocab: int, new_tokens: int) -> tuple[dict[str, float], list[list[int]]]:
    timers: dict[str, list[float]] = defaultdict(list)
    graphs = engine.runner.graphs
    last: list = []
    fill = graphs._fill

    def recording_fill(chunks, b):
        last[:] = [list(chunks)]
        return fill(chunks, b)

    graphs._fill = timed(timers, "input copy (_fill)", recording_fill)
    replay_owner = {b: g for b, (g, _) in graphs.graphs.items()} if engine.runner.device.type == "cuda" else {}
    for g in replay_owner.values():
        g.replay = timed(timers, "replay call", g.replay)
    engine.scheduler.schedule = timed(timers, "schedule", engine.scheduler.schedule)
    engine._resolve_inflight = timed(timers, "resolve previous (wait)", engine._resolve_inflight)
    engine.sampler.launch = timed(timers, "queue sampling", engine.sampler.launch)
    engine._emit_pending = timed(timers, "emit text", engine._emit_pending)
    gen = GenerationConfig(max_new_tokens=new_tokens, top_k=1, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    streams = [engine.generate(torch.randint(3, vocab, (256,), generator=g).tolist(), gen) for _ in range(batch)]
    steps = []
    while True:
        start = time.perf_counter()
        if not engine.step():
            break
        steps.append(time.perf_counter() - start)
    tokens = [s.result().token_ids for s in streams]
    decode = new_tokens - 2  # the prefill step first, then decode steps; the last step resolves only
    out = {name: statistics.median(v[-decode - 1:-1] if len(v) > decode else v) * 1e3 for name, v in timers.items()}
    out["whole step"] = statistics.median(steps[-decode - 1:-1]) * 1e3
    out["decode steps"] = decode
    for owner, attribute in ((engine.scheduler, "schedule"), (engine.sampler, "launch"), (engine, "_resolve_inflight"),
                             (engine, "_emit_pending"), (graphs, "_fill")):
        delattr(owner, attribute)  # back to the class's method
    for g in replay_owner.values():
        del g.replay
    if engine.runner.device.type == "cuda" and last:
        out["GPU alone"] = gpu_alone(engine, last[0])
        out["exposed host"] = out["whole step"] - out["GPU alone"]
    return out, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="fp16", help="int4 or fp16")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU (script check)")
    p.add_argument("--async-output", default="both", choices=("on", "off", "both"),
                   help="overlapped steps (the engine thread's default), step by step, or both (tokens compared)")
    args = p.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    shape = dict(TINY if args.tiny else LLAMA2_7B, num_hidden_layers=2 if args.tiny else args.layers)
    int4 = args.weights == "int4"
    modes = ["off", "on"] if args.async_output == "both" else [args.async_output]
    results: dict[str, dict] = {}
    tokens: dict[str, dict[int, list[list[int]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ws = build_workspace(Path(tmp, "ws"), shape, int4, 1024, device)
        if int4 and device.type == "cuda":
            prewarm_int4(ws, 16, device)
            os.environ["LMD_W4A16_AUTOTUNE"] = "0"  # prefill (M > 16) on the default plans: not timed here
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        dtype = "fp16" if device.type == "cuda" else "fp32"
        for mode in modes:
            with Engine(ws, start=False, device=str(device), dtype=dtype, max_batch_size=max(sizes),
                        session_len=1024, async_output=mode == "on") as engine:
                if engine.runner.graphs is None:  # CPU: the graphs' static buffers, run eagerly
                    engine.runner.enable_decode_graphs(capture=False)
                profile(engine, 1, shape["vocab_size"], 4)  # warm-up: first-use costs
                runs = {b: profile(engine, b, shape["vocab_size"], args.new_tokens) for b in sizes}
            results[mode] = {b: r for b, (r, _) in runs.items()}
            tokens[mode] = {b: t for b, (_, t) in runs.items()}
    same = {b: tokens["on"][b] == tokens["off"][b] for b in sizes} if len(modes) == 2 else {}
    out = Path(os.environ.get("OUT", "."), "engine_step_profile.json")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out.write_text(json.dumps(dict(gpu=gpu, weights=args.weights, layers=args.layers, rows=results,
                                   same_tokens=same), indent=1))
    name = "tiny" if args.tiny else "llama2-7b"
    print(f"\n{gpu}, {args.weights} {name} shape ({shape['num_hidden_layers']} layers): median ms per decode step")
    for mode, rows in results.items():
        print(f"async_output {mode}")
        names = list(dict.fromkeys(n for r in rows.values() for n in r if n != "decode steps"))
        print(f"{'part':26}" + "".join(f"{'batch ' + str(b):>11}" for b in rows))
        for part in names:
            print(f"{part:26}" + "".join(f"{r.get(part, 0.0):11.3f}" for r in rows.values()))
    if same:
        print("greedy tokens overlapped == step by step: " + ", ".join(f"batch {b}: {v}" for b, v in same.items()))


if __name__ == "__main__":
    main()
