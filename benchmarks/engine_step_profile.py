"""Where one decode step of the engine spends its time, host side and GPU side (a CUDA machine).

    python3 benchmarks/engine_step_profile.py [--weights fp16] [--batch-sizes 1,16,64] [--layers 32]

A random-weight Llama-2-7B-shaped workspace (benchmarks/engine.py's writer; int4 plans tuned for M <= 16 first)
runs greedy requests (256 prompt tokens, 64 new) through `Engine.step()` on this thread, with a timer around each
host part of the step (none of them adds a synchronisation): scheduling, the decode graph's input copy (`_fill`), the
replay call, resolving the previous step (its wait for the GPU included), queueing the sampling, and the text
deltas; and the GPU's own time for each step's graph, from CUDA events recorded around the replay. "exposed host" =
whole step - GPU (graph): the time per step the GPU waits for the host (overlap's target: <= 0.1 ms).
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


class EventTimedReplay:
    """A graph's replay with CUDA events recorded on the stream before and after it (no synchronisation): the
    GPU's own time for the step's graph, read after the run."""

    def __init__(self, replay: Callable[[], None], pairs: list) -> None:
        self.replay, self.pairs = replay, pairs

    def __call__(self) -> None:
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        self.replay()
        after.record()
        self.pairs.append((before, after))


def profile(engine: Engine, batch: int, vocab: int, new_tokens: int) -> tuple[dict[str, float], list[list[int]]]:
    timers: dict[str, list[float]] = defaultdict(list)
    graphs = engine.runner.graphs
    graphs._fill = timed(timers, "input copy (_fill)", graphs._fill)
    replay_owner = {b: g for b, (g, _) in graphs.graphs.items()} if engine.runner.device.type == "cuda" else {}
    pairs: list = []
    for g in replay_owner.values():
        g.replay = timed(timers, "replay call", EventTimedReplay(g.replay, pairs))
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
    if pairs:
        torch.cuda.synchronize()
        out["GPU (graph)"] = statistics.median(b.elapsed_time(a) for b, a in pairs[-decode - 1:-1])
        out["exposed host"] = out["whole step"] - out["GPU (graph)"]
    return out, tokens


def differing(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(requests whose tokens differ, the earliest position of a difference; -1 if none)."""
    firsts = [next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), -1)
              for p, q in zip(a, b, strict=True)]
    hits = [i for i in firsts if i >= 0]
    return len(hits), min(hits, default=-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="fp16", help="int4 or fp16")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU (script check)")
    p.add_argument("--async-output", default="off,on",
                   help="runs, each on a fresh engine: on = overlapped steps (the engine thread's default), off = "
                        "step by step; every run's greedy tokens are compared with the first run's")
    args = p.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    shape = dict(TINY if args.tiny else LLAMA2_7B, num_hidden_layers=2 if args.tiny else args.layers)
    int4 = args.weights == "int4"
    modes = args.async_output.split(",")
    results: dict[str, dict] = {}
    tokens: dict[str, dict[int, list[list[int]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ws = build_workspace(Path(tmp, "ws"), shape, int4, 1024, device)
        if int4 and device.type == "cuda":
            prewarm_int4(ws, 16, device)
            os.environ["LMD_W4A16_AUTOTUNE"] = "0"  # prefill (M > 16) on the default plans: not timed here
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        dtype = "fp16" if device.type == "cuda" else "fp32"
        for run, mode in enumerate(modes):
            with Engine(ws, start=False, device=str(device), dtype=dtype, max_batch_size=max(sizes),
                        session_len=1024, async_output=mode == "on") as engine:
                if engine.runner.graphs is None:  # CPU: the graphs' static buffers, run eagerly
                    engine.runner.enable_decode_graphs(capture=False)
                profile(engine, 1, shape["vocab_size"], 4)  # warm-up: first-use costs
                runs = {b: profile(engine, b, shape["vocab_size"], args.new_tokens) for b in sizes}
            label = f"{run}: async_output {mode}"
            results[label] = {b: r for b, (r, _) in runs.items()}
            tokens[label] = {b: t for b, (_, t) in runs.items()}
    first, *others = tokens
    same = {other: {b: differing(tokens[first][b], tokens[other][b]) for b in sizes} for other in others}
    out = Path(os.environ.get("OUT", "."), "engine_step_profile.json")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out.write_text(json.dumps(dict(gpu=gpu, weights=args.weights, layers=args.layers, rows=results,
                                   same_tokens=same), indent=1))
    name = "tiny" if args.tiny else "llama2-7b"
    print(f"\n{gpu}, {args.weights} {name} shape ({shape['num_hidden_layers']} layers): median ms per decode step")
    for label, rows in results.items():
        print(label)
        names = list(dict.fromkeys(n for r in rows.values() for n in r if n != "decode steps"))
        print(f"{'part':26}" + "".join(f"{'batch ' + str(b):>11}" for b in rows))
        for part in names:
            print(f"{part:26}" + "".join(f"{r.get(part, 0.0):11.3f}" for r in rows.values()))
    for other, by_batch in same.items():
        print(f"greedy tokens of run {other} against run {first}: "
              + ", ".join(f"batch {b}: {n} requests differ" + (f" (first at token {i})" if n else "")
                          for b, (n, i) in by_batch.items()))


if __name__ == "__main__":
    main()
