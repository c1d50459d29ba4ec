"""What bounds lmd's wgmma W4A16 GEMM from 256 rows (issue 18: ~350 TFLOP/s at 1024 rows against cuBLAS's ~710)?
Times the kernel as lmd builds it, then copies of it with one piece of work taken out, so that the time each piece
costs shows (a CUDA machine with sm_90):

    rs         the RS form as built: consumers load raw words from shared memory and decode their A fragments
    rs-nodec   RS without the decode (the raw word is the A fragment)
    rs-noload  RS without the raw-word loads (a register value stands in; the decode stays)
    rs-bare    RS without both: the pipeline, the x copies and the wgmmas on x in shared memory alone
    ss         the SS form as built: the producer warpgroup decodes into an A tile in shared memory
    ss-nodec   SS with the producer copying only (A left as it is)

The variants compute wrong outputs on purpose and only their time is read; the built forms are checked against
the reference first. fp16 cuBLAS on the same shapes runs in the same process. In a CUDA graph over weight copies
worth more than L2, as the probe times.

    python3 benchmarks/w4a16_wgmma_bound.py [--shapes 12288x4096,22016x4096] [--ms 256,1024]
    python3 benchmarks/w4a16_wgmma_bound.py --ncu 12288x4096 --m 1024 --config "wgmma n256 t128 s6 k1 rs" \
        --variant rs      (five eager launches, for ncu)

Writes $OUT/w4a16_wgmma_bound.json; prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmd.turbomind.kernels import nvrtc  # noqa: E402
from lmd.turbomind.kernels import w4a16_wgmma as wg  # noqa: E402
from lmd.turbomind.kernels.gpu_timing import graph_ms  # noqa: E402
from lmd.turbomind.kernels.w4a16 import output_is_wrong, random_weight  # noqa: E402
from lmd.turbomind.kernels.w4a16_layout import w4a16_matmul_reference  # noqa: E402

GROUP = 128
RS_DECODE = "a[kk % SETS][e][r] = natural_pair(q, pair_select, cs2[e][r & 1], z2[e][r & 1]);"
RS_LOAD = "const u32 q = lds32(stage + RAW_OFFSET + (2 * kk + (r >> 1)) * BN * 4 + (n + 8 * (r & 1)) * 4);"
SS_DECODE = "dequant_stage(base + s * STAGE_BYTES, scale_c2, one, sixteen, offset_a);"
PATCHES = {
    "rs": (), "ss": (),
    "rs-nodec": ((RS_DECODE, "a[kk % SETS][e][r] = q;"),),
    "rs-noload": ((RS_LOAD, "const u32 q = (u32)(n * 16 + kk * 4 + r) * 0x01010101u;"),),
    "rs-bare": ((RS_DECODE, "a[kk % SETS][e][r] = q;"), (RS_LOAD, "const u32 q = (u32)(n * 16 + kk * 4 + r);")),
    "ss-nodec": ((SS_DECODE, "(void)scale_c2;"),),
}


def patched_source(source: str, variant: str) -> str:
    for old, new in PATCHES[variant]:
        assert old in source, f"w4a16_wgmma.cu changed: update this script's {variant} patch"
        source = source.replace(old, new)
    return source


@functools.cache
def _kernel(variant: str, cfg: wg.WgmmaConfig, pdl: bool, device: int) -> nvrtc.Kernel:
    source = patched_source(wg.kernel_source(torch.float16, GROUP, cfg, pdl), variant)
    return nvrtc.compile_kernel(source, "w4a16_wgmma", device, arch_suffix="a")


def run(variant: str, cfg: wg.WgmmaConfig, x: torch.Tensor, qw: torch.Tensor, s: torch.Tensor,
        z: torch.Tensor) -> torch.Tensor:
    """One launch as `wgmma_gemm` makes it, of the variant's source."""
    return wg.launch_with(lambda pdl, device: _kernel(variant, cfg, pdl, device), x, qw, s, z, None, cfg)


def config_named(name: str, m: int, n: int, k: int) -> wg.WgmmaConfig:
    configs = {c.name(): c for c in wg.tuner_configs(m, n, k, GROUP)}
    if name not in configs:
        raise SystemExit(f"--config {name}: not a tuner config here; one of {', '.join(configs)}")
    return configs[name]


def precompile(shapes: list[tuple[int, int]], ms: list[int]) -> None:
    """Build every (variant, config) the run launches on a thread pool (NVRTC takes ~1 s a build)."""
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    from lmd.turbomind.kernels.pdl import pdl_enabled

    device = torch.cuda.current_device()
    pdl = pdl_enabled(torch.device("cuda", device))
    jobs = {(v, cfg) for n, k in shapes for m in ms for cfg in wg.tuner_configs(m, n, k, GROUP) for v in PATCHES
            if v.startswith("rs" if cfg.rs else "ss")}

    def build(job: tuple[str, wg.WgmmaConfig]) -> None:
        with contextlib.suppress(Exception):  # a failing build shows again, with its message, at its first launch
            _kernel(job[0], job[1], pdl, device)

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(build, sorted(jobs, key=str)))


def bench(n: int, k: int, m: int) -> dict:
    dev = torch.device("cuda")
    qw, s, z = random_weight(n, k, GROUP, torch.float16, dev)
    x = torch.randn(m, k, device=dev, dtype=torch.float16)
    copies = max(4, -(-256 * 2**20 // (qw.numel() * 4)))
    weights = [(qw.clone(), s.clone(), z.clone()) for _ in range(copies)]
    flops = 2.0 * m * n * k
    dense = torch.randn(n, k, device=dev, dtype=torch.float16)
    fp16_w = [dense.clone() for _ in range(max(2, -(-256 * 2**20 // dense.numel() // 2)))]
    fp16_us = graph_ms([lambda w=w: F.linear(x, w) for w in fp16_w], 20) * 1e3
    del fp16_w
    ref = w4a16_matmul_reference(x.float(), qw, s, z)
    row = {"n": n, "k": k, "m": m, "fp16_us": fp16_us, "fp16_tflops": flops / fp16_us / 1e6, "configs": {}}
    print(f"{n}x{k} m={m}: fp16 cuBLAS {fp16_us:.1f} µs ({row['fp16_tflops']:.0f} TFLOP/s)", flush=True)
    for cfg in wg.tuner_configs(m, n, k, GROUP):
        if cfg.block_t > m:
            continue
        variants = [v for v in PATCHES if v.startswith("rs" if cfg.rs else "ss")]
        built = variants[0]
        if output_is_wrong(run(built, cfg, x, qw, s, z), ref):
            print(f"  {cfg.name()}: WRONG OUTPUT, not timed", flush=True)
            continue
        times = {}
        for variant in variants:
            times[variant] = graph_ms([lambda w=w, v=variant, c=cfg: run(v, c, x, *w) for w in weights], 20) * 1e3
        row["configs"][cfg.name()] = times
        print(f"  {cfg.name():28} " + "  ".join(f"{v} {t:6.1f} µs ({flops / t / 1e6:4.0f} TF/s)"
                                                for v, t in times.items()), flush=True)
    return row


def ncu_target(shape: str, m: int, config: str, variant: str) -> None:
    n, k = (int(v) for v in shape.split("x"))
    qw, s, z = random_weight(n, k, GROUP, torch.float16, torch.device("cuda"))
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    cfg = config_named(config, m, n, k)
    for _ in range(5):
        run(variant, cfg, x, qw, s, z)
    torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="12288x4096,22016x4096", help="N x K, comma-separated")
    p.add_argument("--ms", default="256,1024", help="token rows, comma-separated")
    p.add_argument("--ncu", metavar="NxK", help="only launch one shape/config/variant five times (for ncu)")
    p.add_argument("--m", type=int, default=1024, help="with --ncu: token rows")
    p.add_argument("--config", default="wgmma n256 t128 s6 k1 rs", help="with --ncu: a wgmma tuner config name")
    p.add_argument("--variant", default="rs", choices=list(PATCHES), help="with --ncu: the source variant")
    args = p.parse_args()
    if args.ncu:
        ncu_target(args.ncu, args.m, args.config, args.variant)
        return
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    precompile(shapes, ms)
    rows = [bench(n, k, m) for n, k in shapes for m in ms]
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "w4a16_wgmma_bound.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"\nwgmma W4A16 g128, {torch.cuda.get_device_name()}: µs per call, best config of each form (TFLOP/s)")
    print(f"{'N x K':11} {'M':>5} {'fp16':>12}  " + "  ".join(f"{v:>16}" for v in PATCHES))
    for r in rows:
        flops = 2.0 * r["m"] * r["n"] * r["k"]
        cells = []
        for v in PATCHES:
            ts = [t[v] for t in r["configs"].values() if v in t]
            cells.append(f"{min(ts):7.1f} ({flops / min(ts) / 1e6:4.0f})" if ts else f"{'-':>16}")
        print(f"{r['n']}x{r['k']:<6} {r['m']:5d} {r['fp16_us']:6.1f} ({r['fp16_tflops']:3.0f})  " + "  ".join(cells))


if __name__ == "__main__":
    main()
