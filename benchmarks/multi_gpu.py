"""Tensor and pipeline parallelism over the GPUs of one host (issue 21): greedy tokens against one rank, decode
ms/token by layout, and the all-reduce a layer makes against the bus bandwidth of large all-reduces on the same GPUs.

    python3 benchmarks/multi_gpu.py [--shapes 7b,13b] [--layouts 1x1,2x1,4x1,8x1,1x2,2x2] [--batch-sizes 1,64]
    python3 benchmarks/multi_gpu.py --tiny        # CPU and gloo: a tiny model through every step in seconds

Random fp16 weights (benchmarks/engine.py's builder), one workspace a shape, written for --workspace-tp ranks (the
engine merges and re-cuts rank files for any other tp, at start). A layout is tp x pp (tp ranks in each of pp
stages); those needing more GPUs than the machine has are skipped. For each layout:
1. greedy tokens of --check-prompts random prompts x --check-tokens new tokens, against the 1x1 run: identical, or
   the first (prompt, token) where they differ (reductions in another order may flip a near tie);
2. decode ms/token at each batch size (lmd.bench's latency run: --input-len in, --output-len out).
The layouts of --eager-layouts run once more with decode CUDA graphs off ("2x1 eager"): what the graphs give at tp > 1,
where each rank replays its own with NCCL inside (the table's "graphs" column says whether a layout captured them).
Then, for each tp of the layouts, tp ranks all-reduce a [batch, hidden] fp16 tensor (what a decoder layer reduces,
twice a layer) and, for the bus bandwidth, tensors of 16 MiB to 1 GiB: bytes x 2 (tp - 1) / tp / time, the figure
NCCL's all_reduce_perf reports as busbw. NCCL on CUDA (gloo on CPU), NVLink multicast off in every process
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). Writes $OUT/multi_gpu.json and
prints the tables last, with issue 21's ratios: 13B tp=2 against tp=1 at batch 1, and any shape's tp=8 batch 1
against 7B tp=1.

The 1000 real-length requests at tp > 1 are `benchmarks/serving_workloads.py --workloads real --no-peer --tp N`;
data-parallel replicas, one engine a GPU serving every N-th of them, are `benchmarks/data_parallel.py --replicas N`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_parallel import NO_MULTICAST  # noqa: E402

os.environ.update(NO_MULTICAST)  # before any NCCL

import torch  # noqa: E402
from engine import LLAMA2_7B, SHAPE_KEYS, TINY, build_workspace  # noqa: E402

from lmd.bench.latency import LatencyConfig, run_latency  # noqa: E402
from lmd.errors import LmdError  # noqa: E402
from lmd.workspace_format.rank_layout import RankShape, check_tp  # noqa: E402

SHAPES = {
    "7b": LLAMA2_7B,
    "13b": dict(zip(SHAPE_KEYS, (5120, 13824, 40, 40, 40), strict=True), vocab_size=32000),
    "70b": dict(zip(SHAPE_KEYS, (8192, 28672, 80, 64, 8), strict=True), vocab_size=32000),
    "tiny": TINY,
}
BUS_SIZES_MIB = (16, 64, 256, 1024)
TINY_BUS_SIZES_MIB = (1, 4)


def parse_layout(text: str) -> tuple[int, int]:
    try:
        tp, pp = (int(v) for v in text.split("x"))
    except ValueError:
        raise SystemExit(f"--layouts {text}: write each as TPxPP, e.g. 2x1") from None
    if tp < 1 or pp < 1:
        raise SystemExit(f"--layouts {text}: tp and pp are at least 1")
    return tp, pp


def fits(shape: dict, tp: int, pp: int) -> str | None:
    """Why the layout cannot split this shape (the engine's own tp check), or None."""
    heads = shape["num_attention_heads"]
    try:
        check_tp(tp, RankShape(heads, shape["num_key_value_heads"], shape["hidden_size"] // heads,
                               shape["intermediate_size"]))
    except LmdError as exc:
        return str(exc)
    if shape["num_hidden_layers"] < pp:
        return f"{shape['num_hidden_layers']} layers for {pp} stages"
    return None


def engine_options(args: argparse.Namespace, tp: int, pp: int, graphs: bool = True) -> dict:
    options = dict(device=args.device, dtype=args.dtype, tp=tp, pp=pp, session_len=args.session_len,
                   max_batch_size=max(max(args.batch_sizes), args.check_prompts), cuda_graph=graphs)
    if args.tiny:  # a small KV pool: the CPU holds one per rank
        options.update(cache_max_entry_count=64, max_context_token_num=64)
    return options


def greedy_tokens(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from lmd.turbomind.gen_config import GenerationConfig

    config = GenerationConfig(max_new_tokens=tokens, temperature=0, ignore_eos=True)
    streams = [engine.generate(p, config) for p in prompts]
    return [s.result().token_ids for s in streams]


def first_difference(got: list[list[int]], want: list[list[int]]) -> list[int] | None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        for j, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return [i, j]
        if len(a) != len(b):
            return [i, min(len(a), len(b))]
    return None


def run_layout(ws: Path, args: argparse.Namespace, tp: int, pp: int, prompts: list[list[int]],
               graphs: bool = True) -> dict:
    from lmd.turbomind.engine import Engine

    start = time.perf_counter()
    with Engine(ws, **engine_options(args, tp, pp, graphs)) as engine:
        result: dict = {"start_s": time.perf_counter() - start, "decode_graphs": engine.runner.graphs is not None}
        result["tokens"] = greedy_tokens(engine, prompts, args.check_tokens)
        config = LatencyConfig(args.input_len, args.output_len, tuple(args.batch_sizes), args.warmup, args.iters,
                               args.seed)
        result["decode_ms"] = {}
        for batch in run_latency(engine, config):
            decode = batch.decode_per_token()
            result["decode_ms"][batch.batch_size] = decode.mean * 1e3
    return result


def _all_reduce_rank(rank: int, tp: int, port: int, device: str, cases: list[tuple[str, int]], reps: int,
                     out: str) -> None:
    """One rank of the all-reduce timing: each case is (name, elements: fp16 on CUDA, fp32 under gloo); rank 0
    writes the median µs."""
    import torch.distributed as dist

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    timings = {}
    for name, elements in cases:
        t = torch.ones(elements, dtype=torch.float16 if cuda else torch.float32, device=dev)
        for _ in range(3):
            dist.all_reduce(t)
        samples = []
        for _ in range(reps):
            dist.barrier()
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                dist.all_reduce(t)
                end.record()
                end.synchronize()
                samples.append(begin.elapsed_time(end) * 1e3)
            else:
                begin_s = time.perf_counter()
                dist.all_reduce(t)
                samples.append((time.perf_counter() - begin_s) * 1e6)
        timings[name] = statistics.median(samples)
    if rank == 0:
        Path(out).write_text(json.dumps(timings))
    dist.barrier()
    dist.destroy_process_group()


def all_reduce_times(tp: int, args: argparse.Namespace) -> dict[str, dict]:
    """Per shape: µs per all-reduce over tp ranks of its layer's [batch, hidden] at each batch size, and the bus
    bandwidth (GB/s) of the large sizes, which all shapes share (one set of ranks, one sweep)."""
    import torch.multiprocessing as mp

    from lmd.turbomind.tp_group import free_port

    sizes = TINY_BUS_SIZES_MIB if args.tiny else BUS_SIZES_MIB
    element = 2 if args.device == "cuda" else 4
    cases = [(f"{name} layer batch {b}", b * SHAPES[name]["hidden_size"]) for name in args.shapes
             for b in args.batch_sizes]
    cases += [(f"{mib} MiB", mib * 2**20 // element) for mib in sizes]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "timings.json"))
        mp.spawn(_all_reduce_rank, args=(tp, free_port(), args.device, cases, args.reps, out), nprocs=tp, join=True)
        timings = json.loads(Path(out).read_text())
    bus_us = {f"{mib} MiB": timings[f"{mib} MiB"] for mib in sizes}
    bus = {f"{mib} MiB": mib * 2**20 * 2 * (tp - 1) / tp / (bus_us[f"{mib} MiB"] * 1e-6) / 1e9 for mib in sizes}
    return {name: {"us": {case.removeprefix(f"{name} "): us for case, us in timings.items()
                          if case.startswith(f"{name} layer ")} | bus_us, "bus_gb_s": bus}
            for name in args.shapes}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU with gloo and small defaults (script check)")
    p.add_argument("--shapes", help="comma list of 7b, 13b, 70b (default 7b,13b; tiny: tiny)")
    p.add_argument("--layouts", help="comma list of TPxPP (default 1x1,2x1,4x1,8x1,1x2,2x2; tiny 1x1,2x1,1x2)")
    p.add_argument("--eager-layouts", default="2x1",
                   help="comma list of TPxPP run again with decode CUDA graphs off ('' for none)")
    p.add_argument("--workspace-tp", type=int, default=1, help="ranks the workspace's weight files are cut for")
    p.add_argument("--batch-sizes", help="decode batch sizes (default 1,64; tiny 1,2)")
    p.add_argument("--input-len", type=int, help="prompt tokens of the latency runs (default 128; tiny 8)")
    p.add_argument("--output-len", type=int, help="tokens generated in the latency runs (default 128; tiny 4)")
    p.add_argument("--check-prompts", type=int, default=8, help="prompts of the greedy-token check")
    p.add_argument("--check-tokens", type=int, help="tokens each check prompt generates (default 64; tiny 6)")
    p.add_argument("--iters", type=int, default=3, help="timed latency iterations a batch size")
    p.add_argument("--warmup", type=int, default=1, help="untimed latency iterations a batch size")
    p.add_argument("--reps", type=int, default=20, help="timed all-reduces a size")
    p.add_argument("--session-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    big = not args.tiny
    defaults = dict(shapes="7b,13b" if big else "tiny", layouts="1x1,2x1,4x1,8x1,1x2,2x2" if big else "1x1,2x1,1x2",
                    batch_sizes="1,64" if big else "1,2", input_len=128 if big else 8, output_len=128 if big else 4,
                    check_tokens=64 if big else 6)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.shapes = args.shapes.split(",")
    for shape in args.shapes:
        if shape not in SHAPES or (shape == "tiny") != args.tiny:
            raise SystemExit(f"--shapes {shape}: one of 7b, 13b, 70b (tiny only with --tiny)")
    args.layouts = [parse_layout(v) for v in args.layouts.split(",")]
    args.eager_layouts = [parse_layout(v) for v in args.eager_layouts.split(",") if v]
    if (1, 1) not in args.layouts:
        args.layouts.insert(0, (1, 1))  # the reference of the token check
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.device = "cpu" if args.tiny else "cuda"
    args.dtype = "fp32" if args.tiny else "fp16"
    if args.tiny:
        args.session_len = min(args.session_len, 128)
    return args


def print_tables(results: dict, args: argparse.Namespace) -> None:
    print(f"\n{results['gpus']} x {results['gpu']}: greedy tokens against 1x1 and decode ms/token by layout (tp x pp)")
    print(f"{'shape':>6} {'layout':>9} {'graphs':>6} {'tokens':>16} "
          + "".join(f"{f'batch {b}':>10}" for b in args.batch_sizes) + f" {'b1 / 1x1':>9}")
    for shape, r in results["shapes"].items():
        base = r["layouts"].get("1x1", {}).get("decode_ms", {})
        for layout, v in r["layouts"].items():
            if "skipped" in v:
                print(f"{shape:>6} {layout:>9} skipped: {v['skipped']}")
                continue
            tokens = "identical" if v["first_difference"] is None else f"differ at {v['first_difference']}"
            cells = "".join(f"{v['decode_ms'][b]:10.2f}" for b in args.batch_sizes)
            ratio = v["decode_ms"][args.batch_sizes[0]] / base[args.batch_sizes[0]] if base else float("nan")
            graphs = "yes" if v["decode_graphs"] else "no"
            print(f"{shape:>6} {layout:>9} {graphs:>6} {tokens:>16} {cells} {ratio:9.2f}")
    print("\nall-reduce µs (the layer's [batch, hidden], twice a decoder layer) and bus bandwidth GB/s "
          "(bytes x 2(tp-1)/tp / time)")
    for tp, shapes in results["all_reduce"].items():
        for shape, v in shapes.items():
            layer = ", ".join(f"{name} {us:.1f}" for name, us in v["us"].items() if name.startswith("layer"))
            bus = ", ".join(f"{name} {gb:.0f}" for name, gb in v["bus_gb_s"].items())
            print(f"  tp {tp} {shape}: {layer}; busbw {bus}")
    for goal, value in results["goals"].items():
        print(f"  {goal}: {value:.2f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 4  # --tiny: up to 4 gloo ranks on the CPU
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    results: dict = {"gpu": gpu, "gpus": gpus, "torch": torch.__version__, "shapes": {}, "all_reduce": {},
                     "goals": {}}
    g = torch.Generator().manual_seed(args.seed)
    for name in args.shapes:
        shape = SHAPES[name]
        prompts = [torch.randint(3, shape["vocab_size"], (args.input_len,), generator=g).tolist()
                   for _ in range(args.check_prompts)]
        root = Path(tempfile.mkdtemp(prefix=f"lmd-multi-gpu-{name}-"))
        try:
            start = time.perf_counter()
            ws = build_workspace(root / "ws", shape, False, args.session_len, torch.device(args.device),
                                 tp=args.workspace_tp)
            print(f"[{name}] workspace written in {time.perf_counter() - start:.0f} s", flush=True)
            layouts: dict = {}
            runs = [(tp, pp, True) for tp, pp in args.layouts] + [(tp, pp, False) for tp, pp in args.eager_layouts]
            for tp, pp, graphs in runs:
                label = f"{tp}x{pp}" + ("" if graphs else " eager")
                why = fits(shape, tp, pp) or (f"{tp * pp} ranks, {gpus} GPUs" if tp * pp > gpus else None)
                if why:
                    layouts[label] = {"skipped": why}
                    continue
                r = run_layout(ws, args, tp, pp, prompts, graphs)
                reference = layouts.get("1x1", r)["tokens"]
                r["first_difference"] = first_difference(r["tokens"], reference)
                layouts[label] = r
                print(f"[{name}] {label}: tokens {'identical' if r['first_difference'] is None else 'differ'}, "
                      f"decode ms/token {r['decode_ms']}, start {r['start_s']:.0f} s", flush=True)
            results["shapes"][name] = {"layouts": layouts}
        finally:
            shutil.rmtree(root, ignore_errors=True)
    for tp in sorted({tp for tp, _ in args.layouts if 1 < tp <= gpus}):
        results["all_reduce"][tp] = all_reduce_times(tp, args)
    done = {name: {k: v for k, v in r["layouts"].items() if "decode_ms" in v} for name, r in results["shapes"].items()}
    b1 = args.batch_sizes[0]
    if "2x1" in done.get("13b", {}) and "1x1" in done["13b"]:
        results["goals"]["13b tp=2 / tp=1, batch 1 (goal <= 0.6)"] = (done["13b"]["2x1"]["decode_ms"][b1]
                                                                      / done["13b"]["1x1"]["decode_ms"][b1])
    if "1x1" in done.get("7b", {}):
        for name, layouts in done.items():
            if "8x1" in layouts:
                results["goals"][f"{name} tp=8 / 7b tp=1, batch 1 (goal <= 1.5 for 70b)"] = (
                    layouts["8x1"]["decode_ms"][b1] / done["7b"]["1x1"]["decode_ms"][b1])
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "multi_gpu.json").write_text(json.dumps(results, indent=1))
    print_tables(results, args)


if __name__ == "__main__":
    main()
