"""int4 quality of `lmd awq`'s methods on SmolLM2-135M-Instruct, on one GPU (issue 16's goal on full sets): WikiText-2
perplexity over all windows and zero-shot accuracy over the full local sets of ARC-Easy, ARC-Challenge, PIQA,
HellaSwag and WinoGrande, float and int4, through the same functions `lmd awq`'s quality report calls.

    python3 benchmarks/int4_quality_gpu.py MODEL.gguf [--runs awq-gptq:64,rtn:64,awq-gptq:32,awq:64,autoround:64]
        [--timeout 240]

Per run: `lmd awq MODEL --method M --w-group-size G --device cuda --eval-windows 0 --eval-tasks <five>
--eval-items 100000 --calib-dataset c4 --json`; gap ratio = (ppl - fp) / (RTN g64 - fp). The first run also scores
the float model (the rest reuse its figures); its checkpoint is then read back and scored again by `lmd eval tasks`
(acc and acc_norm), beside the float model's, so the table of record is the checkpoint users deploy. LMD_DATA_DIR
must hold the data sets.
Writes $OUT/int4_quality_gpu.json, prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASKS = "arc_easy,arc_challenge,piqa,hellaswag,winogrande"


def lmd(args: list[str], timeout: float) -> dict | None:
    """The JSON of one `lmd ... --json` command (None when it failed or ran out of time; its stderr is printed)."""
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "lmd", *args, "--json"], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"timed out after {timeout:.0f} s: lmd {' '.join(args)}", flush=True)
        return None
    wall = time.perf_counter() - start
    if done.returncode != 0:
        print(f"rc {done.returncode}: lmd {' '.join(args)}\n{done.stderr[-2000:]}", flush=True)
        return None
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_seconds"] = round(wall, 1)
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--runs", default="awq-gptq:64,rtn:64,awq-gptq:32,awq:64,autoround:64", help="method:group, ...")
    p.add_argument("--timeout", type=float, default=240, help="seconds per command")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp())
    results: dict = {"runs": []}
    for i, run in enumerate(args.runs.split(",")):
        method, group = run.split(":")
        work = root / f"{method}-g{group}"
        cmd = ["awq", args.model, "--method", method, "--w-group-size", group, "--device", "cuda", "--work-dir",
               str(work), "--eval-windows", "0", "--eval-tasks", TASKS, "--eval-items", "100000", "--calib-dataset", "c4"]
        report = lmd(cmd if i == 0 else [*cmd, "--no-eval-fp"], args.timeout)
        if report is None:
            continue
        if i == 0:
            results.update(fp_ppl=report.get("fp_ppl"), fp_acc=report.get("fp_acc"))
            for label, model in (("fp", args.model), ("int4_checkpoint", str(work))):
                scored = lmd(["eval", "tasks", model, "--tasks", TASKS, "--device", "cuda"], args.timeout)
                results[f"{label}_tasks"] = scored
        results["runs"].append({**report, "run": run, "group": int(group)})
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_quality_gpu.json").write_text(json.dumps(results, indent=1))
    fp_ppl, fp_acc = results.get("fp_ppl"), results.get("fp_acc") or {}
    rtn_ppl = next((r.get("int4_ppl") for r in results["runs"] if r["run"] == "rtn:64"), None)
    print(f"\nfp ppl {fp_ppl}  fp acc {json.dumps(fp_acc)}")
    print("method      group  quantize s  ppl       gap ratio  mean acc drop  per task (int4 - fp, points)")
    for r in results["runs"]:
        acc = r.get("int4_acc") or {}
        drops = {t: 100 * (acc[t] - fp_acc[t]) for t in acc if t in fp_acc}
        mean = sum(drops.values()) / len(drops) if drops else float("nan")
        ratio = ((r["int4_ppl"] - fp_ppl) / (rtn_ppl - fp_ppl) if fp_ppl and rtn_ppl and r.get("int4_ppl")
                 else float("nan"))
        name = r["run"].split(":")[0]
        print(f"{name:<11} {r['group']:>5}  {r['quantize_seconds']:>10.1f}  {r.get('int4_ppl', 0):<9.4f} "
              f"{ratio:>9.3f}  {-mean:>13.2f}  " + ", ".join(f"{t} {d:+.1f}" for t, d in drops.items()))


if __name__ == "__main__":
    main()
