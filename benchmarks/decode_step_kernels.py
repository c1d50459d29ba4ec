"""Where the GPU time of one decode step goes, per kernel: Llama-2-7B-shaped fp16 (or int4) random weights, a batch of
decoding sequences at a short and a long context (issue 14, deliverable 3). A CUDA machine.

    python3 benchmarks/decode_step_kernels.py [--batch 64] [--contexts 128,1024] [--steps 10] [--weights int4]

For each context the engine (start=False, CUDA graphs off so that every kernel launch is visible) prefills `batch`
prompts of that length, decodes a few warm-up steps, then runs `steps` decode steps under torch.profiler. Kernel
times are summed per kernel name and divided by the number of steps; kernels are also grouped (GEMM, attention,
fused layer ops, sampling and logits, copies, other). The whole GPU step with graph replay is timed separately
with CUDA events (same batch, same context) for comparison. `--prefill N`: each profiled step also admits a new
prompt of N tokens, so it is a mixed step (eager in the engine; no graph replay then). Last, the skinny-GEMM
planner's timings of the linears it tuned in this process (cuBLAS against its best candidate per rows bucket). Writes
$OUT/decode_step_kernels.json, prints tables.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import LLAMA2_7B, SHAPE_KEYS, build_workspace  # noqa: E402
from kernel_timeline import Timeline, timeline  # noqa: E402

from lmd.turbomind.engine import Engine  # noqa: E402
from lmd.turbomind.gen_config import GenerationConfig  # noqa: E402
from lmd.turbomind.kernels import dense_gemv_plan as dense_plan  # noqa: E402
from lmd.turbomind.kernels import w4a16  # noqa: E402
from lmd.turbomind.kernels.w4a16_shipped_plans import OPT_IN_FAMILIES, family  # noqa: E402
from lmd.turbomind.kernels.w4a16_timer import tune_timer  # noqa: E402

SHAPES = {"llama2-7b": LLAMA2_7B,  # Llama-3-8B: 32 heads / 8 KV heads, vocab 128256
          "llama3-8b": dict(zip(SHAPE_KEYS, (4096, 14336, 32, 32, 8), strict=True), vocab_size=128256)}
GROUPS = (  # first match wins: (group, substrings of the kernel name, lower case)
    ("attention", ("_attention_kernel", "_decode_mha_kernel", "_combine_kernel", "flash", "sdpa", "attention")),
    ("fused layer ops", ("rms", "silu", "rotary", "rope", "norm")),
    ("GEMM", ("nvjet", "gemm", "gemv", "dense_mma", "split_sum", "cutlass", "_wt_kernel", "sm90_xmma", "ampere", "cublas",
              "matmul", "splitk")),
    ("sampling + logits", ("argmax", "softmax", "topk", "sort", "max", "reduce", "log_softmax", "cumsum")),
    ("copies + index", ("copy", "index", "gather", "scatter", "fill", "cat", "elementwise")),
)


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in GROUPS if any(k in low for k in keys)), "other")


def decoding_engine(ws: Path, args: argparse.Namespace, context: int, cuda_graph: bool, device: str) -> Engine:
    engine = Engine(ws, start=False, device=device, dtype="fp16" if device == "cuda" else "fp32",
                    max_batch_size=args.batch + (args.steps + 1 if args.prefill else 0),
                    session_len=max(context, args.prefill) + 256, cache_max_entry_count=0.5,
                    max_context_token_num=max(2048, context, args.batch + args.steps + args.prefill + 1),
                    cuda_graph=cuda_graph, quant_policy=args.quant_policy, step_length=1)
    g = torch.Generator().manual_seed(context)
    gen = GenerationConfig(max_new_tokens=10**4, temperature=0, ignore_eos=True)
    vocab = engine.workspace.model.vocab_size
    for _ in range(args.batch):
        engine.generate(torch.randint(3, vocab, (context,), generator=g).tolist(), gen)
    engine.step()  # admits the requests (they wait in the inbox until a step)
    while engine.stats().waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()  # prefill every prompt
    assert len(engine.scheduler.running) == args.batch, "every sequence decodes (raise cache_max_entry_count)"
    for _ in range(3):
        engine.step()  # warm-up decode steps
    return engine


def admit_prompt(engine: Engine, tokens: int) -> None:
    """--prefill: queue one prompt of `tokens` random ids (none for 0), admitted by the next step."""
    if tokens:
        vocab = engine.workspace.model.vocab_size
        gen = GenerationConfig(max_new_tokens=10**4, temperature=0, ignore_eos=True)
        engine.generate(torch.randint(3, vocab, (tokens,)).tolist(), gen)


W4A16_KERNELS = ("_gemv_kernel", "_wt_kernel", "_gemm_kernel")  # Triton; lmd's CUDA ones start with "w4a16_"
LINEARS = ("qkv", "o", "gate+up", "down")  # a layer's W4A16 linears in launch order


def is_w4a16(name: str) -> bool:
    return name in W4A16_KERNELS or name.startswith("w4a16_")


def w4a16_by_linear(events: list) -> dict[str, dict[str, float]]:
    """The W4A16 kernels of the profile in launch order, one per linear (at decode batch sizes each linear is one
    kernel, split-K joined inside it), assigned to LINEARS by position: µs per call (median) and the kernel's name."""
    calls = sorted((e for e in events if e.device_type.name == "CUDA" and is_w4a16(e.name)),
                   key=lambda e: e.time_range.start)
    out = {}
    for i, linear in enumerate(LINEARS):
        mine = calls[i::len(LINEARS)]
        if mine:
            us = sorted(e.time_range.elapsed_us() for e in mine)
            out[linear] = {"us": us[len(us) // 2], "calls": len(us), "kernels": sorted({e.name for e in mine})}
    return out


def kernel_profile(engine: Engine, steps: int, prefill: int) -> tuple[dict[str, float], dict[str, dict]]:
    from torch.profiler import ProfilerActivity, profile

    admit_prompt(engine, prefill)  # a first mixed step outside the profile (new shapes, compiles)
    engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            admit_prompt(engine, prefill)
            engine.step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for avg in prof.key_averages():
        if avg.device_type.name == "CUDA":  # kernels and memcpys
            per_kernel[avg.key] += avg.self_device_time_total / 1e3 / steps  # us -> ms per step
    return dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])), w4a16_by_linear(list(prof.events()))


def running_batch_graph(engine: Engine) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The decode graph of the engine's running batch with its static buffers filled for a step, and that step's
    logits (one row a sequence): each sequence's last computed position again, whose block exists (the next one
    may not be allocated yet)."""
    graphs = engine.runner.graphs
    assert graphs is not None, "decode graphs were not captured"
    chunks = [([s.token_ids[-2]], len(s) - 2, list(s.block_table)) for s in engine.scheduler.running]
    logits = graphs.run(chunks)
    return graphs.graphs[graphs.bucket(len(chunks))][0], logits


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """ms a replay over `replays` back-to-back replays (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def graph_step_ms(engine: Engine, steps: int) -> tuple[float, Timeline, dict[str, float]]:
    """The whole step by graph replay (CUDA events, `steps` replays), and, from `steps` more replays under
    torch.profiler, the kernel timeline (its idle time and gaps) and ms a step by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    graph, _ = running_batch_graph(engine)
    ms = replay_ms(graph, steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]
    per_kernel: dict[str, float] = defaultdict(float)
    for name, start_us, end_us in kernels:
        per_kernel[name] += (end_us - start_us) / 1e3 / steps
    return ms, timeline(kernels), dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=14, help="kernels listed per context")
    p.add_argument("--quant-policy", type=int, default=0, choices=(0, 4), help="KV cache: 0 fp16, 4 online int8")
    p.add_argument("--shape", default="llama2-7b", choices=tuple(SHAPES), help="model shape (random weights)")
    p.add_argument("--prefill", type=int, default=0, help="tokens of a new prompt admitted by every profiled step")
    p.add_argument("--weights", default="fp16", choices=("fp16", "int4"), help="fp16, or AWQ int4 g128 (W4A16)")
    args = p.parse_args()
    device = "cuda"
    contexts = [int(c) for c in args.contexts.split(",")]
    results: dict = {"gpu": torch.cuda.get_device_name(), "batch": args.batch, "steps": args.steps,
                     "prefill": args.prefill, "weights": args.weights,
                     "quant_policy": args.quant_policy, "contexts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ws = build_workspace(Path(tmp, "ws"), SHAPES[args.shape], args.weights == "int4", 2048, torch.device(device))
        for context in contexts:
            engine = decoding_engine(ws, args, context, cuda_graph=False, device=device)
            kernels, by_linear = kernel_profile(engine, args.steps, args.prefill)
            results["dense_plans"] = {f"{rows} rows {n}x{k} {dtype}": timings
                                      for (rows, n, k, dtype), timings in dense_plan.TUNE_LOG.items()}
            results["w4a16_plans"] = {f"{key.bucket} rows {key.n}x{key.k}": sorted(timings, key=lambda t: t[1])
                                      for key, timings in w4a16.TUNE_LOG.items()}
            engine.close()
            del engine  # its weights and KV pool go before the next engine sizes its own
            gc.collect()
            torch.cuda.empty_cache()
            replay, graph_timeline = None, None
            if not args.prefill:
                engine = decoding_engine(ws, args, context, cuda_graph=True, device=device)
                replay, replay_timeline, replay_kernels = graph_step_ms(engine, args.steps)
                per_step = 1e3 * args.steps  # µs over the profiled replays -> ms a step
                graph_timeline = {"span_ms": replay_timeline.span_us / per_step,
                                  "busy_ms": replay_timeline.busy_us / per_step,
                                  "idle_ms": replay_timeline.idle_us / per_step, "kernels_ms": replay_kernels,
                                  "gaps_ms": [{"after": a, "before": b, "ms": us / per_step,
                                               "per_step": replay_timeline.gap_counts[(a, b)] / args.steps}
                                              for (a, b), us in replay_timeline.gaps_us.items()]}
                engine.close()
                del engine
                gc.collect()
                torch.cuda.empty_cache()
            groups: dict[str, float] = defaultdict(float)
            for name, ms in kernels.items():
                groups[group_of(name)] += ms
            results["contexts"][context] = {"graph_replay_ms": replay, "kernel_sum_ms": sum(kernels.values()),
                                            "groups_ms": dict(groups), "kernels_ms": kernels,
                                            "w4a16_by_linear": by_linear,
                                            "graph_timeline": graph_timeline}
    Path(os.environ.get("OUT", "."), "decode_step_kernels.json").write_text(json.dumps(results, indent=1))
    for context, r in results["contexts"].items():
        kv = "int8" if args.quant_policy == 4 else "fp16"
        replay = "" if r["graph_replay_ms"] is None else f"graph replay {r['graph_replay_ms']:.3f} ms/step, "
        print(f"\n{results['gpu']}, {args.weights} {args.shape} shape, KV {kv}, batch {args.batch}, context {context}"
              + (f", + a {args.prefill}-token prompt per step" if args.prefill else "")
              + f": {replay}eager kernels sum {r['kernel_sum_ms']:.3f} ms")
        if r["graph_timeline"] is not None:
            g = r["graph_timeline"]
            print(f"  graph replay, profiled: span {g['span_ms']:.3f} ms a step, a kernel running {g['busy_ms']:.3f}, "
                  f"idle {g['idle_ms']:.3f}; largest idle transitions (ms a step, gaps a step):")
            for gap in g["gaps_ms"][:6]:
                print(f"    {gap['ms']:7.3f} {gap['per_step']:6.1f}  {gap['after'][:48]} -> {gap['before'][:48]}")
            print("  ms a step by kernel, graph replay against eager:")
            for name, ms in list(g["kernels_ms"].items())[:6]:
                print(f"    {ms:8.3f} {r['kernels_ms'].get(name, float('nan')):8.3f}  {name[:100]}")
        for group, ms in sorted(r["groups_ms"].items(), key=lambda kv: -kv[1]):
            print(f"  {group:20} {ms:8.3f}")
        for name, ms in list(r["kernels_ms"].items())[: args.top]:
            print(f"    {ms:8.3f}  {name[:110]}")
        for linear, v in r["w4a16_by_linear"].items():
            print(f"  w4a16 {linear:8} {v['us']:7.1f} µs a call (median of {v['calls']}), {', '.join(v['kernels'])}")
    print("\nskinny-GEMM planner, µs per call as timed at load (cuBLAS, then the best candidate; empty: plans from the "
          "disk cache)")
    for shape, timings in results.get("dense_plans", {}).items():
        best = min((t for t in timings.items() if t[0] != "cublas"), key=lambda t: t[1], default=("-", float("nan")))
        print(f"  {shape:28} cuBLAS {timings['cublas'] * 1e3:7.2f}   {best[0]:32} {best[1] * 1e3:7.2f}")
    print(f"W4A16 tuner, µs per call as its {tune_timer()} timer timed them at load (the winner, then the best CUDA "
          "and Triton candidates; empty: plans from a table or the disk cache)")
    for shape, timings in results.get("w4a16_plans", {}).items():
        if not timings:  # no candidate ran correctly: the default plan, untimed
            print(f"  {shape:22} (no candidate ran correctly: the default plan)")
            continue
        cuda = next((t for t in timings if family(t[0]) in OPT_IN_FAMILIES), ("-", float("nan")))
        other = next((t for t in timings if family(t[0]) not in OPT_IN_FAMILIES), ("-", float("nan")))
        print(f"  {shape:22} {timings[0][0]:36} {timings[0][1] * 1e3:6.1f}   CUDA {cuda[1] * 1e3:6.1f}   "
              f"Triton {other[1] * 1e3:6.1f}")


if __name__ == "__main__":
    main()
