"""Where one decode step of the engine spends its time, host side and GPU side (a CUDA machine).

    python3 benchmarks/engine_step_profile.py [--weights int4] [--batch-sizes 1,16] [--layers 32]

A random-weight Llama-2-7B-shaped workspace (benchmarks/engine.py's writer; int4 plans tuned for M <= 16 first)
runs greedy requests (256 prompt tokens, 64 new) through `Engine.step()` on this thread, with a timer around each
part of the step: scheduling, the decode graph's input copy (`_fill`), the replay call, waiting for the GPU to finish
the replay (a synchronize inserted for the measurement: the step is synchronous anyway, the sampler reads its tokens
back), sampling, and post-processing (detokenize, stop checks, stream put). Reports the median per decode step of
each part and of the whole step. Writes $OUT/engine_step_profile.json; prints a table last.
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


class TimedGraph:
    """Stands in for a captured CUDA graph: times the replay call and the GPU's work after it separately."""

    def __init__(self, graph, timers: dict[str, list[float]], device: torch.device) -> None:
        self.graph, self.timers, self.device = graph, timers, device

    def replay(self) -> None:
        start = time.perf_counter()
        self.graph.replay()
        launched = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.timers["replay call"].append(launched - start)
        self.timers["GPU after the call"].append(time.perf_counter() - launched)


def timed(timers: dict[str, list[float]], name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        timers[name].append(time.perf_counter() - start)
        return out

    return wrapper


def profile(engine: Engine, batch: int, vocab: int, new_tokens: int) -> dict[str, float]:
    timers: dict[str, list[float]] = defaultdict(list)
    graphs = engine.runner.graphs
    if graphs is not None:
        graphs.graphs = {b: (TimedGraph(g, timers, engine.runner.device), out) for b, (g, out) in graphs.graphs.items()}
        graphs._fill = timed(timers, "input copy (_fill)", graphs._fill)
    engine.scheduler.schedule = timed(timers, "schedule", engine.scheduler.schedule)
    engine.sampler.sample = timed(timers, "sample", engine.sampler.sample)
    engine._accept = timed(timers, "accept ids", engine._accept)
    engine._emit_pending = timed(timers, "emit text (overlapped)" if engine._defer_output else "emit text",
                                 engine._emit_pending)
    gen = GenerationConfig(max_new_tokens=new_tokens, top_k=1, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    streams = [engine.generate(torch.randint(3, vocab, (256,), generator=g).tolist(), gen) for _ in range(batch)]
    steps = []
    while True:
        start = time.perf_counter()
        if not engine.step():
            break
        steps.append(time.perf_counter() - start)
    for s in streams:
        s.result()
    decode = len(timers.get("replay call", ())) or len(steps) - 1  # without graphs: all but the prefill step
    out = {name: statistics.median(v[-decode:]) * 1e3 for name, v in timers.items()}  # decode steps come last
    out["whole step"] = statistics.median(steps[-decode:]) * 1e3
    out["decode steps"] = decode
    for owner, attribute in ((engine.scheduler, "schedule"), (engine.sampler, "sample"), (engine, "_accept"),
                             (engine, "_emit_pending")):
        delattr(owner, attribute)  # back to the class's method
    if graphs is not None:
        graphs.graphs = {b: (t.graph, out_) for b, (t, out_) in graphs.graphs.items()}
        del graphs._fill
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="int4", help="int4 or fp16")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU (script check)")
    p.add_argument("--async-output", default="on", choices=("on", "off"),
                   help="stream a step's text while the next step runs (the engine thread's default) or after it")
    args = p.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    shape = dict(TINY if args.tiny else LLAMA2_7B, num_hidden_layers=2 if args.tiny else args.layers)
    int4 = args.weights == "int4"
    with tempfile.TemporaryDirectory() as tmp:
        ws = build_workspace(Path(tmp, "ws"), shape, int4, 1024, device)
        if int4 and device.type == "cuda":
            prewarm_int4(ws, 16, device)
            os.environ["LMD_W4A16_AUTOTUNE"] = "0"  # prefill (M > 16) on the default plans: not timed here
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        dtype = "fp16" if device.type == "cuda" else "fp32"
        with Engine(ws, start=False, device=str(device), dtype=dtype, max_batch_size=max(sizes),
                    session_len=1024, async_output=args.async_output == "on") as engine:
            if engine.runner.graphs is None:  # CPU: the graphs' static buffers, run eagerly
                engine.runner.enable_decode_graphs(capture=False)
            profile(engine, 1, shape["vocab_size"], 4)  # warm-up: first-use costs
            rows = {b: profile(engine, b, shape["vocab_size"], args.new_tokens) for b in sizes}
    out = Path(os.environ.get("OUT", "."), "engine_step_profile.json")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out.write_text(json.dumps(dict(gpu=gpu, weights=args.weights, layers=args.layers, async_output=args.async_output,
                                   rows=rows), indent=1))
    names = [n for n in next(iter(rows.values())) if n != "decode steps"]
    name = "tiny" if args.tiny else "llama2-7b"
    print(f"\n{gpu}, {args.weights} {name} shape ({shape['num_hidden_layers']} layers): median ms per decode step")
    print(f"{'part':22}" + "".join(f"{'batch ' + str(b):>11}" for b in rows))
    for name in names:
        print(f"{name:22}" + "".join(f"{r.get(name, 0.0):11.3f}" for r in rows.values()))


if __name__ == "__main__":
    main()
