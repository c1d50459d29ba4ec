"""Decode attention at batch 64 (Llama-2-7B: 32 KV heads, head dim 128), fp16 KV against online int8 KV, over a grid
of kernel configs: which block_n / warps / stages make int8 KV decode faster than fp16's (issue 14, 5c), and which
make fp16 KV decode faster at short contexts (`--grid-kv fp16`). A CUDA machine.

    python3 benchmarks/attention_int8_sweep.py [--batch 64] [--contexts 128,1024] [--layers 4] [--grid-kv int8,fp16]
                                               [--small-grid] [--batches 1,16,64] [--block-order sequential]

Random K/V codes and (scale, zero) per token (timing does not depend on their values), `--layers` separate pools
visited in turn so L2 never holds the next call's KV; each candidate is a CUDA graph of every layer's decode call x 5,
median of 5 replays, per layer call. Each int8 config's output is checked against the default config's.
`--mha-grid` adds the CUDA-core decode kernel's configs (one query head per KV head), and the dot kernel's, on
either KV (on int8 the dot kernel's entry is its config before the CUDA-core kernel took int8).
`--small-grid`: block_n 32/64 x 1/2/4 warps x 1/2 stages, the context split chosen as the engine does (the decode
configs to choose between by batch size); `--batches` runs the sweep at each batch size in turn. `--block-order`:
each sequence's blocks scattered over the pool at random (default), or consecutive as a fresh engine hands them out.
The KV dtypes not in `--grid-kv` run the default config only. Writes $OUT/attention_int8_sweep.json and prints the
best configs per context and KV dtype last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernels import graph_time_us  # noqa: E402
from lmd.turbomind.kernels.paged_attention import (  # noqa: E402
    AttentionConfig,
    attention_meta,
    default_config,
    paged_attention_triton,
)

HKV, D, BLOCK = 32, 128, 64
GRID = [AttentionConfig(block_n=bn, decode_warps=w, num_stages=s, num_splits=sp)
        for bn, w, s, sp in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (1, 2, 3, 4), (0,))] + [
    AttentionConfig(block_n=bn, decode_warps=w, num_stages=s, num_splits=sp)  # split contexts: shorter programs
    for bn, w, s, sp in ((32, 1, 2, 2), (32, 1, 1, 2), (64, 4, 2, 2), (64, 2, 2, 2), (32, 1, 2, 4), (64, 4, 2, 4))]
SMALL_GRID = [AttentionConfig(block_n=bn, decode_warps=w, num_stages=s)
              for bn, w, s in itertools.product((32, 64), (1, 2, 4), (1, 2))]
# the CUDA-core decode kernel for one query head per KV head (`paged_decode_kernel`), at launches of at least
# WIDE_PROGRAMS_PER_SM programs an SM (its loads are not pipelined: stages change nothing); and the dot kernel's
# configs as the engine ran them before that kernel
MHA_GRID = [AttentionConfig(mha_decode=(bn, w, 1)) for bn, w in itertools.product((8, 16, 32, 64), (1, 2, 4))] + [
    AttentionConfig(wide_decode=(32, 1, 2))]
REPS = 5


def pools(batch: int, ctx: int, layers: int, int8: bool, dev: torch.device, order: str = "random"):
    blocks = batch * -(-ctx // BLOCK)
    g = torch.Generator(device=dev).manual_seed(ctx)
    out = []
    for _ in range(layers):
        if int8:
            k = torch.randint(-128, 128, (blocks, BLOCK, HKV, D), dtype=torch.int8, device=dev, generator=g)
            v = torch.randint(-128, 128, (blocks, BLOCK, HKV, D), dtype=torch.int8, device=dev, generator=g)
            params = torch.rand((2, blocks, BLOCK, HKV, 2), device=dev, generator=g) * 0.02
            out.append((k, v, params[0].half(), params[1].half()))
        else:
            k = torch.randn((blocks, BLOCK, HKV, D), device=dev, generator=g).half()
            v = torch.randn((blocks, BLOCK, HKV, D), device=dev, generator=g).half()
            out.append((k, v, None, None))
    ids = torch.randperm(blocks, device=dev, generator=g) if order == "random" else torch.arange(blocks, device=dev)
    perm = ids.view(batch, -1).to(torch.int32)
    meta = attention_meta(list(range(batch)), [1] * batch, [ctx] * batch, list(perm), dev)
    q = torch.randn((batch, HKV, D), device=dev, generator=g).half()
    return out, meta, q


def time_us(fn, layers: int) -> float:
    """Per layer call: `fn` (every layer's call) REPS times in one CUDA graph, median of 5 replays."""
    return graph_time_us([fn] * REPS, reps=5) / layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--grid-kv", default="int8", help="KV dtypes (fp16, int8) timed over the whole config grid")
    p.add_argument("--small-grid", action="store_true", help="the 12 decode configs of SMALL_GRID, not the full grid")
    p.add_argument("--mha-grid", action="store_true",
                   help="also the CUDA-core MHA decode kernel's configs and the dot kernel's (MHA_GRID)")
    p.add_argument("--block-order", default="random", choices=("random", "sequential"),
                   help="blocks of a sequence: scattered at random, or consecutive")
    p.add_argument("--batches", default="", help="comma list of batch sizes, each swept in turn (overrides --batch)")
    args = p.parse_args()
    results = []
    for batch in [int(b) for b in args.batches.split(",") if b] or [args.batch]:
        results += sweep(batch, args)
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention_int8_sweep.json").write_text(json.dumps(results, indent=1))
    grid_kv = set(args.grid_kv.split(","))
    for batch, ctx in sorted({(r["batch"], r["ctx"]) for r in results}):
        rows = [r for r in results if r["ctx"] == ctx and r["batch"] == batch]
        base = [r for r in rows if r["default"]]
        print(f"\nbatch {batch} ctx {ctx}: " + "; ".join(f"{r['kv']} default {r['us']:.1f} µs ({r['tbs']:.2f} TB/s)"
                                                      for r in base))
        for kv in sorted({r["kv"] for r in rows if r["kv"] in grid_kv or r.get("mha_decode") or r["wide_decode"]}):
            for r in sorted((r for r in rows if r["kv"] == kv), key=lambda r: r["us"])[:8]:
                wide = f" (wide decode {r['wide_decode']})" if r["wide_decode"] else ""
                wide += " (CUDA-core MHA)" if r.get("mha_decode") else ""
                print(f"  {kv} bn{r['block_n']} w{r['warps']} st{r['stages']} sp{r['splits']}{wide}: {r['us']:.1f} µs "
                      f"({r['tbs']:.2f} TB/s), max diff {r['error']:.1e}")


def sweep(batch: int, args: argparse.Namespace) -> list[dict]:
    grid_kv = set(args.grid_kv.split(","))
    grid = [c for c in SMALL_GRID if c != default_config(D, torch.float16)] if args.small_grid else GRID
    dev = torch.device("cuda")
    scale = D ** -0.5
    results = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for int8 in (False, True):
            layers, meta, q = pools(batch, ctx, args.layers, int8, dev, args.block_order)

            def run(cfg: AttentionConfig, layers=layers, meta=meta, q=q) -> list[torch.Tensor]:
                return [paged_attention_triton(q, k, v, meta, scale, k_param=kp, v_param=vp, config=cfg)
                        for k, v, kp, vp in layers]

            default = default_config(D, torch.float16)
            ref = run(default)[0].float()
            swept = list(grid) if ("int8" if int8 else "fp16") in grid_kv else []
            swept += MHA_GRID if args.mha_grid else []
            for cfg in [default] + swept:
                try:
                    out = run(cfg)[0].float()
                    error = (out - ref).abs().max().item()
                    us = time_us(lambda c=cfg: run(c), args.layers)
                except Exception as exc:  # noqa: BLE001 (a config that does not compile)
                    print(f"ctx {ctx} {'int8' if int8 else 'fp16'} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                kv_bytes = batch * ctx * HKV * D * 2 * (1 if int8 else 2)
                results.append(dict(batch=batch, ctx=ctx, kv="int8" if int8 else "fp16", default=cfg == default,
                                    **dict(zip(("block_n", "warps", "stages"), cfg.mha_decode or (
                                        cfg.block_n, cfg.decode_warps, cfg.num_stages), strict=True)),
                                    splits=cfg.num_splits, wide_decode=cfg.wide_decode,
                                    mha_decode=cfg.mha_decode, us=us,
                                    tbs=kv_bytes / us / 1e6, error=error))
            del layers
            torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
