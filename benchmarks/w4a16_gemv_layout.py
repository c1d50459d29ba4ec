"""Does the weight layout bound the W4A16 GEMV at one token row? The mma.sync GEMV (`w4a16_mma_gemv`) on the engine
layout, where a CTA's 64 output channels are 256-byte pieces of rows N x 4 bytes apart, against the same kernel on
a tiled copy of the weights, where each 64-channel block is one contiguous [K/8, 64] run (issue 18: the deploy-time
reorder). Timing only: the tiled variant is this script's patch of the kernel source (its addresses, nothing else),
so its outputs must pass the tuner's check against the reference, which runs first. A CUDA machine.

    python3 benchmarks/w4a16_gemv_layout.py [--shapes 12288x4096,...]
    python3 benchmarks/w4a16_gemv_layout.py --ncu 22016x4096 --layout tiled --config "m8 w8 g4 pf1"   (under ncu)

Per shape and layout (engine; tiled words; tiled words, scales and zeros): µs per call of the best tuner config at
M = 1, and on the engine layout of the best cp.async-staged config (`engine staged`), in a CUDA graph over weight
copies worth more than L2 (as the probe), its TB/s, and a device-to-device copy of the same bytes for the ceiling
(TB/s counting bytes read and written). Writes $OUT/w4a16_gemv_layout.json, prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmd.turbomind.kernels import nvrtc  # noqa: E402
from lmd.turbomind.kernels import w4a16_mma_gemv as gemv  # noqa: E402
from lmd.turbomind.kernels.gpu_timing import graph_ms  # noqa: E402
from lmd.turbomind.kernels.w4a16 import output_is_wrong, random_weight  # noqa: E402
from lmd.turbomind.kernels.w4a16_layout import w4a16_matmul_reference  # noqa: E402

SHAPES = "12288x4096,4096x4096,22016x4096,4096x11008"
GROUP = 128
ENGINE_WORDS = "const u32* p = qw + (u64)(gi * GSTEPS * 4 + s * 4 + t) * N + col;"
TILED_WORDS = ("const u32* p = qw + (u64)blockIdx.y * KROWS * 64 + (u64)(gi * GSTEPS * 4 + s * 4 + t) * 64"
               " + (col - blockIdx.y * 64);")
ENGINE_SZ = ("    load_weight_pair(scales + (u64)gi * N + col, d.s.x, d.s.y);\n"
             "    load_weight_pair(scales + (u64)gi * N + col + 32, d.s.z, d.s.w);\n"
             "    load_weight_pair(zeros + (u64)gi * N + col, d.z.x, d.z.y);\n"
             "    load_weight_pair(zeros + (u64)gi * N + col + 32, d.z.z, d.z.w);\n")
TILED_SZ = ENGINE_SZ.replace("(u64)gi * N + col",
                             "(u64)blockIdx.y * NGROUPS * 64 + (u64)gi * 64 + (col - blockIdx.y * 64)")
LAYOUTS = ("engine", "tiled", "tiled+sz")


def tiled_source(layout: str, k: int) -> str:
    """The kernel source reading a tiled layout: the engine source with the weight addresses patched."""
    source = gemv.SOURCE
    assert ENGINE_WORDS in source and ENGINE_SZ in source, "w4a16_mma_gemv.cu changed: update this script's patch"
    source = source.replace(ENGINE_WORDS, TILED_WORDS)
    if layout == "tiled+sz":
        source = source.replace(ENGINE_SZ, TILED_SZ)
    return f"#define KROWS {k // 8}\n#define NGROUPS {k // GROUP}\n" + source


def tile(t: torch.Tensor) -> torch.Tensor:
    """[R, N] -> the same shape whose memory holds the [N/64, R, 64] blocks one after another."""
    r, n = t.shape
    return t.reshape(r, n // 64, 64).permute(1, 0, 2).contiguous().reshape(r, n)


@functools.cache
def _tiled_kernel(layout: str, k: int, cfg: gemv.MmaGemvConfig, pdl: bool, device: int) -> nvrtc.Kernel:
    source = gemv.kernel_source(torch.float16, GROUP, cfg, pdl).replace(gemv.SOURCE, tiled_source(layout, k))
    return nvrtc.compile_kernel(source, "w4a16_mma_gemv", device)


def run(layout: str, cfg: gemv.MmaGemvConfig, x: torch.Tensor, qw: torch.Tensor, s: torch.Tensor,
        z: torch.Tensor) -> torch.Tensor:
    """The GEMV on the engine layout (lmd's launch), or on a tiled one (the patched kernel, launched as lmd does)."""
    if layout == "engine":
        return gemv.mma_gemv(x, qw, s, z, None, cfg)
    k = x.shape[1]
    grid = gemv.launch_shape(cfg, x.shape[0], qw.shape[1], k, GROUP)
    return gemv.launch_w4a16(lambda pdl, device: _tiled_kernel(layout, k, cfg, pdl, device), x, qw, s, z, None,
                             grid, [cfg.warps * cfg.groups_per_warp], grid[0] * grid[1] if grid[2] > 1 else 0,
                             32 * cfg.warps, shared_bytes=cfg.shared_bytes(GROUP))


def operands(layout: str, qw: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if layout == "engine":
        return qw, s, z
    return (tile(qw), tile(s), tile(z)) if layout == "tiled+sz" else (tile(qw), s, z)


def parse_config(text: str, n: int, k: int) -> gemv.MmaGemvConfig:
    """The tuner config at M = 1 whose name is `text` (with or without the leading "mma-gemv ")."""
    configs = {c.name(): c for c in gemv.tuner_configs(1, n, k, GROUP, staged=True)}
    cfg = configs.get(text if text.startswith("mma-gemv ") else f"mma-gemv {text}")
    if cfg is None:
        raise SystemExit(f"--config {text}: not a tuner config at M = 1; one of {', '.join(configs)}")
    return cfg


def ncu_target(shape: str, layout: str, config: str) -> None:
    """Five eager launches of one config: what ncu profiles (--launch-skip 2 --launch-count 1)."""
    n, k = (int(v) for v in shape.split("x"))
    qw, s, z = random_weight(n, k, GROUP, torch.float16, torch.device("cuda"))
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    ops, cfg = operands(layout, qw, s, z), parse_config(config, n, k)
    for _ in range(5):
        run(layout, cfg, x, *ops)
    torch.cuda.synchronize()


def bench(n: int, k: int, layouts: list[str]) -> dict:
    dev = torch.device("cuda")
    qw, s, z = random_weight(n, k, GROUP, torch.float16, dev)
    x = torch.randn(1, k, device=dev, dtype=torch.float16)
    q_bytes = qw.numel() * 4 + 2 * s.numel() * 2
    copies = max(4, -(-256 * 2**20 // q_bytes))
    configs = gemv.tuner_configs(1, n, k, GROUP, staged=True)
    ref = w4a16_matmul_reference(x.float(), qw, s, z)
    result = {"n": n, "k": k, "bytes": q_bytes, "layouts": {}}
    flat = [torch.empty(q_bytes // 4, dtype=torch.int32, device=dev) for _ in range(copies)]
    dst = torch.empty_like(flat[0])
    copy_us = graph_ms([lambda f=f: dst.copy_(f) for f in flat], 30) * 1000.0
    result["copy_us"], result["copy_tb_s"] = copy_us, 2 * q_bytes / (copy_us * 1e-6) / 1e12
    for layout in layouts:
        weights = [operands(layout, qw.clone(), s.clone(), z.clone()) for _ in range(copies)]
        timings = {}
        for cfg in configs:
            if cfg.stages and layout != "engine":  # the tiled patch covers load_weights, not the staged copies
                continue
            y = run(layout, cfg, x, *weights[0])
            if output_is_wrong(y, ref):  # split-K adds in fp32 atomically: equal to a rounding, not bit for bit
                print(f"{layout} {cfg.name()} {n}x{k}: WRONG OUTPUT, not timed", flush=True)
                continue
            timings[cfg] = graph_ms([lambda w=w, c=cfg, lay=layout: run(lay, c, x, *w) for w in weights], 30) * 1e3
        del weights
        for staged in (False, True):
            mine = {cfg.name(): us for cfg, us in timings.items() if bool(cfg.stages) == staged}
            if not mine:
                continue
            best = min(mine, key=mine.get)
            variant = f"{layout} staged" if staged else layout
            result["layouts"][variant] = {"best": best, "us": mine[best],
                                          "tb_s": q_bytes / (mine[best] * 1e-6) / 1e12, "timings": mine}
            print(f"{n}x{k} {variant:14} best {best:30} {mine[best]:6.1f} µs "
                  f"{result['layouts'][variant]['tb_s']:.2f} TB/s (copy {result['copy_tb_s']:.2f})", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="N x K of each linear, comma-separated")
    p.add_argument("--ncu", metavar="NxK", help="only launch one shape/layout/config five times (for ncu)")
    p.add_argument("--layout", default="engine", choices=LAYOUTS)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="layouts timed, comma-separated")
    p.add_argument("--config", default="m8 w8 g4 pf1", help="with --ncu: an mma-gemv config name")
    args = p.parse_args()
    if args.ncu:
        ncu_target(args.ncu, args.layout, args.config)
        return
    layouts = args.layouts.split(",")
    rows = [bench(*(int(v) for v in shape.split("x")), layouts) for shape in args.shapes.split(",")]
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "w4a16_gemv_layout.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{torch.cuda.get_device_name()}, M = 1, group {GROUP}: best mma-gemv config per layout, µs (TB/s of "
          "words, scales and zeros); copy: the same bytes copied device to device (TB/s read + written)")
    variants = list(dict.fromkeys(v for r in rows for v in r["layouts"]))
    print(f"{'N x K':>12} " + " ".join(f"{v:>16}" for v in variants) + f" {'copy':>6}")
    for r in rows:
        cells = " ".join((f"{r['layouts'][v]['us']:.1f} ({r['layouts'][v]['tb_s']:.2f})" if v in r["layouts"]
                          else "wrong").rjust(16) for v in variants)
        print(f"{r['n']:>6}x{r['k']:<5} {cells} {r['copy_tb_s']:6.2f}")


if __name__ == "__main__":
    main()
