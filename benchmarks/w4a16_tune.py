"""Tune the W4A16 plans of the Llama-2-7B int4 linears (the engine's shapes: qkv, o, gate+up, down) for every M
bucket up to --max-m, and report what it costs and what wins (issue 18). A CUDA machine.

    python3 benchmarks/w4a16_tune.py [--max-m 8448] [--shapes 12288x4096,4096x4096,22016x4096,4096x11008]

Always tunes (the on-disk plan cache and the shipped tables are off here). Per (shape, bucket): tuning wall time,
candidates timed, the winner and its time, the next four, and the fastest candidate of each kernel family. Writes
$OUT/w4a16_tune.json and, in the format lmd ships (`lmd/turbomind/kernels/w4a16_shipped_plans.py`), the winners as
$OUT/<gpu>.json (`<gpu>.graph.json` under LMD_W4A16_TIMER=graph, which times candidates as a decode step runs them:
lmd/turbomind/kernels/w4a16_timer.py): copied to lmd/turbomind/kernels/w4a16_plans/, it spares a first engine start on
that GPU the tuning.
Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["LMD_W4A16_PLAN_CACHE"] = "0"  # always tune: the timings are the results
from lmd.turbomind.kernels import w4a16_mma_gemv as mma_gemv  # noqa: E402
from lmd.turbomind.kernels import w4a16_shipped_plans as shipped  # noqa: E402
from lmd.turbomind.kernels import w4a16_wgmma as wgmma  # noqa: E402
from lmd.turbomind.kernels.w4a16 import TUNE_LOG, m_bucket, plan_for, plan_key, random_weight  # noqa: E402
from lmd.turbomind.kernels.w4a16_timer import tune_timer  # noqa: E402

SHAPES = "12288x4096,4096x4096,22016x4096,4096x11008"  # N (out) x K (in): qkv, o, gate+up, down
GROUP = 128


def write_table(rows: list[dict], gpu: str, out: Path) -> Path:
    """The winners as the table lmd ships for this GPU (fp16 activations, group GROUP)."""
    import triton

    plans = {shipped.entry_key(r["bucket"], r["n"], r["k"], GROUP, "float16"): r["plan"] for r in rows if r["timed"]}
    timer = tune_timer()
    path = out / shipped.table_file(gpu, timer).name
    shapes = ",".join(dict.fromkeys(f"{r['n']}x{r['k']}" for r in rows))
    source = ("" if timer == "cold" else f"LMD_W4A16_TIMER={timer} ") + f"benchmarks/w4a16_tune.py --shapes {shapes}"
    cuda = mma_gemv.cuda_kernels(torch.device("cuda"))
    # by family: under the default the GEMV was offered up to 16 rows only and the wgmma GEMM's RS form from 256 (on
    # sm_90), so a table tuned so never judges the GEMV past 16 rows (where it loses; docs/benchmarks.md,
    # twenty-third session) nor the rest of the wgmma configs
    default = ["mma-gemv", "wgmma"] if wgmma.runs_on(torch.device("cuda")) else ["mma-gemv"]
    opt_in = {"none": [], "default": default, "all": list(shipped.OPT_IN_FAMILIES)}[cuda]
    path.write_text(shipped.table_json(gpu, triton.__version__, source, plans, opt_in, timer))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-m", type=int, default=8192 + 256, help="largest row count a step can have")
    p.add_argument("--shapes", default=SHAPES, help="N x K of each linear, comma-separated")
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        qweight, scales, zeros = random_weight(n, k, GROUP, torch.float16, dev)
        bucket = 1
        while True:
            start = time.perf_counter()
            plan = plan_for(bucket, qweight, scales, zeros, torch.float16)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            log = sorted(TUNE_LOG.get(plan_key(bucket, qweight, scales, torch.float16), []), key=lambda t: t[1])
            best_of: dict[str, tuple[str, float]] = {}
            for name, ms in log:
                best_of.setdefault(shipped.family(name), (name, ms))
            rows.append(dict(n=n, k=k, bucket=bucket, seconds=seconds, timed=len(log), plan=plan.name(),
                             top=log[:5], best_of_family=best_of))
            print(f"{n}x{k} M<={bucket}: {seconds:.1f} s, {len(log)} timed, {plan.name()}"
                  + (f" {log[0][1] * 1000:.1f} µs" if log else " (no candidate ran correctly)"), flush=True)
            if bucket >= m_bucket(args.max_m):
                break
            bucket *= 2
        # after every shape: a call stopped at its time limit still returns the shapes it finished
        out = Path(os.environ.get("OUT", "."))
        out.mkdir(parents=True, exist_ok=True)
        (out / "w4a16_tune.json").write_text(json.dumps(rows, indent=1))
        write_table(rows, torch.cuda.get_device_name(dev), out)
    total = sum(r["seconds"] for r in rows)
    print(f"\ntuning wall time {total:.0f} s over {len(rows)} (shape, bucket) pairs")
    print(f"{'shape':>12} {'M':>5} {'s':>6} {'timed':>5}  winner (µs); best of each other family")
    for r in rows:
        top = r["top"][0][1] * 1000 if r["top"] else float("nan")
        others = ", ".join(f"{f} {ms * 1000:.1f}" for f, (name, ms) in r["best_of_family"].items()
                           if name != r["plan"])
        print(f"{r['n']}x{r['k']:<6} {r['bucket']:>5} {r['seconds']:>6.1f} {r['timed']:>5}  {r['plan']} ({top:.1f}); "
              f"{others}")


if __name__ == "__main__":
    main()
