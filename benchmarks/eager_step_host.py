"""Where the host time of an eager (mixed) engine step goes: the step that runs a prefill chunk beside the batch's
decodes (issue 14; the twelfth session measured 29-36 ms of launch per such step for 32 layers on the H200, as long
as the step's GPU time). A CUDA machine; `--tiny` checks the script on CPU.

    python3 benchmarks/eager_step_host.py [--shape llama3-8b] [--layers 8] [--batch 64] [--prefill 128] [--steps 5]

A random-weight workspace of the shape with `--layers` decoder layers (the launch cost is per layer); `--batch`
sequences of 200 tokens decode, then each measured step admits one more prompt of `--prefill` tokens, so it runs
eagerly. The runner's `run` is timed on the host (it returns once the work is queued) and on the GPU (CUDA events),
and profiled with cProfile; the table lists the functions with the most own time per step, then the per-layer
launch cost. Writes $OUT/eager_step_host.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode_step_kernels import SHAPES  # noqa: E402
from engine import TINY, build_workspace  # noqa: E402

from lmd.turbomind.engine import Engine  # noqa: E402
from lmd.turbomind.gen_config import GenerationConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=tuple(SHAPES))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prefill", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU (script check)")
    p.add_argument("--pad", default="off,on", help="runs with the runner's padding of eager steps off and/or on")
    args = p.parse_args()
    results = [measure(args, pad == "on") for pad in args.pad.split(",")]
    Path(os.environ.get("OUT", "."), "eager_step_host.json").write_text(json.dumps(results, indent=1))
    for result in results:
        report(result, args.top)


def measure(args: argparse.Namespace, pad: bool) -> dict:
    device = "cpu" if args.tiny else "cuda"
    shape = dict(TINY if args.tiny else SHAPES[args.shape])
    shape["num_hidden_layers"] = 2 if args.tiny else args.layers
    batch = min(args.batch, 4) if args.tiny else args.batch
    context = 24 if args.tiny else 200
    with tempfile.TemporaryDirectory() as tmp:
        ws = build_workspace(Path(tmp, "ws"), shape, False, 2048, torch.device(device))
        engine = Engine(ws, start=False, device=device, dtype="fp32" if args.tiny else "fp16",
                        max_batch_size=batch + args.steps + 1, session_len=1024, cache_max_entry_count=0.5,
                        max_context_token_num=max(2048, batch * context), step_length=1)  # every step admits
        engine.runner.pad_eager = pad
        g = torch.Generator().manual_seed(0)
        vocab = engine.workspace.model.vocab_size
        gen = GenerationConfig(max_new_tokens=10**4, temperature=0, ignore_eos=True)
        for _ in range(batch):
            engine.generate(torch.randint(3, vocab, (context,), generator=g).tolist(), gen)
        for _ in range(4):
            engine.step()  # prefill, then decode
        runner = engine.runner
        original = type(runner).run.__get__(runner)
        profiler = cProfile.Profile()
        host, gpu, events = [], [], []
        cuda = device == "cuda"

        def measured(output, *rest, **kwargs):
            if all(len(c.token_ids) == 1 for c in output.chunks):
                return original(output, *rest, **kwargs)  # decode steps (graphs) are not measured
            start = end = None
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            profiler.enable()
            out = original(output, *rest, **kwargs)
            profiler.disable()
            host.append((time.perf_counter() - t) * 1e3)
            if cuda:
                end.record()
                events.append((start, end))
            return out

        runner.run = measured
        for _ in range(args.steps + 1):  # the first mixed step warms up (compiles); dropped below
            engine.generate(torch.randint(3, vocab, (args.prefill,), generator=g).tolist(), gen)
            engine.step()
            engine.step()
        if cuda:
            torch.cuda.synchronize()
            gpu = [s.elapsed_time(e) for s, e in events]
        del runner.run
        engine.close()
    host, gpu = host[1:], gpu[1:]
    stats = pstats.Stats(profiler)
    rows = sorted(((fn, st[2], st[3], st[1]) for fn, st in stats.stats.items()), key=lambda r: -r[1])[:args.top]
    steps = len(host) + 1
    return {"shape": args.shape, "layers": shape["num_hidden_layers"], "batch": batch, "prefill": args.prefill,
            "pad_eager": pad, "host_ms": host, "gpu_ms": gpu,
            "top": [dict(function=f"{Path(fn[0]).name}:{fn[1]} {fn[2]}", tottime_ms_per_step=tt * 1e3 / steps,
                         cumtime_ms_per_step=ct * 1e3 / steps, calls_per_step=n / steps) for fn, tt, ct, n in rows]}


def report(result: dict, top: int) -> None:
    pad = "on" if result["pad_eager"] else "off"
    title = f"function (cProfile: own time; all steps incl. warm-up), padding {pad}"
    print(f"\n{title:<70} {'own ms/step':>11} {'cum ms/step':>11} {'calls/step':>10}")
    for r in result["top"][:top]:
        print(f"{r['function'][:70]:<70} {r['tottime_ms_per_step']:>11.3f} {r['cumtime_ms_per_step']:>11.3f} "
              f"{r['calls_per_step']:>10.1f}")
    layers, host, gpu = result["layers"], result["host_ms"], result["gpu_ms"]
    print(f"\nmixed step, padding {pad}, {layers} layers, {result['batch']} decodes + {result['prefill']} prefill "
          f"tokens: host launch {statistics.median(host):.2f} ms ({statistics.median(host) / layers:.3f} per layer)"
          + (f", GPU {statistics.median(gpu):.2f} ms" if gpu else ""))


if __name__ == "__main__":
    main()
