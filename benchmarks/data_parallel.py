"""Data-parallel replicas, the baseline tensor parallelism must beat (issue 21): N lmd engines, one a GPU, each
serving every N-th of the real-length requests, as N servers behind a round-robin load balancer would.

    python3 benchmarks/data_parallel.py [--replicas N] [--model llama2-7b] [--lengths FILE] [--num-requests 1000]
    python3 benchmarks/data_parallel.py --tiny --replicas 2      # CPU: two tiny replicas, a check of the script

Each replica is `benchmarks/serving_workloads.py --workloads real --no-peer --shard I/N` in a process of its own
(CUDA_VISIBLE_DEVICES=I on a GPU machine; NVLink multicast off, as in every multi-GPU run), started together. Every
replica times its share after its own warm-up, so the replicas' timed runs start at about the same moment and the
aggregate is the sum of their output tokens over the longest of their runs (and its requests per second); TTFT is
the mean over every request. Writes $OUT/data_parallel.json (with each replica's serving_workloads.json under
$OUT/replica_I/) and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).with_name("serving_workloads.py")
# NVLink multicast off in every process of a multi-GPU run (issue 21; multi_gpu.py sets it too)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def replica_command(args: argparse.Namespace, index: int, out: Path) -> list[str]:
    command = [sys.executable, str(SCRIPT), "--workloads", "real", "--no-peer", "--hf-requests", "0",
               "--shard", f"{index}/{args.replicas}", "--out", str(out), "--budget-s", str(args.budget_s)]
    if args.tiny:
        command.append("--tiny")
    else:
        command += ["--models", args.model]
    if args.num_requests is not None:
        command += ["--num-requests", str(args.num_requests)]
    if args.lengths:
        command += ["--lengths", args.lengths]
    return command


def run_replicas(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """Start every replica, wait for all; each one's real-workload report (or why it has none)."""
    processes = []
    for index in range(args.replicas):
        folder = out / f"replica_{index}"
        folder.mkdir(parents=True, exist_ok=True)
        env = os.environ | NO_MULTICAST
        if not args.tiny:
            env["CUDA_VISIBLE_DEVICES"] = str(index)
        log = (folder / "log.txt").open("w")
        processes.append((folder, log, subprocess.Popen(replica_command(args, index, folder), env=env, stdout=log,
                                                        stderr=subprocess.STDOUT)))
    reports = []
    for folder, log, process in processes:
        code = process.wait()
        log.close()
        reports.append(replica_report(folder, code))
    return reports


def replica_report(folder: Path, code: int) -> dict[str, Any]:
    try:
        results = json.loads((folder / "serving_workloads.json").read_text())
    except (OSError, ValueError):
        return {"failed": f"exit code {code}, no serving_workloads.json (see {folder / 'log.txt'})"}
    (model, result), = results["models"].items()
    lmd = result.get("real", {}).get("lmd")
    if lmd is None:
        return {"failed": result.get("skipped") or f"exit code {code}, no lmd run (see {folder / 'log.txt'})"}
    return lmd | {"model": model}


def aggregate(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Every replica's requests and output tokens over the longest run; TTFT weighted by requests."""
    done = [r for r in reports if "failed" not in r]
    if len(done) < len(reports):
        return {"failed": f"{len(reports) - len(done)} of {len(reports)} replicas did not finish"}
    requests = sum(r["requests"] for r in done)
    tokens = sum(r["output_tokens"] for r in done)
    seconds = max(r["total_s"] for r in done)
    ttft = sum(r["ttft_ms"]["mean"] * r["requests"] for r in done) / requests
    return {"requests": requests, "output_tokens": tokens, "total_s": seconds, "requests_per_s": requests / seconds,
            "output_tokens_per_s": tokens / seconds, "ttft_ms": {"mean": ttft}}


def print_table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    where = "on the CPU" if results["model"] == "tiny" else "one GPU each"
    table = Table(title=f"data-parallel replicas, {results['model']}: {results['replicas']}, {where} "
                        f"-> {results['out']}")
    for col in ("replica", "requests", "out tokens", "total s", "req/s", "out tok/s", "TTFT mean ms", "notes"):
        table.add_column(col, justify="left" if col in ("replica", "notes") else "right")

    def row(label: str, r: dict[str, Any]) -> None:
        if "failed" in r:
            table.add_row(label, *["-"] * 6, r["failed"])
            return
        table.add_row(label, str(r["requests"]), f"{r['output_tokens']:,}", f"{r['total_s']:.2f}",
                      f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:,.1f}",
                      f"{r['ttft_ms']['mean']:,.1f}", "")

    for index, r in enumerate(results["replicas_runs"]):
        row(str(index), r)
    row("all", results["aggregate"])
    Console(width=140).print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, help="engines, one a GPU (default: every GPU; --tiny: 2)")
    p.add_argument("--model", default="llama2-7b", help="a serving_workloads.py model (not with --tiny)")
    p.add_argument("--num-requests", type=int, help="requests of the whole workload, dealt among the replicas "
                                                    "(default: serving_workloads.py's, 1000; tiny 12)")
    p.add_argument("--lengths", help="token counts written by serving_workloads.py --prepare")
    p.add_argument("--budget-s", type=float, default=510, help="each replica's budget (serving_workloads.py's)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of data_parallel.json")
    p.add_argument("--tiny", action="store_true", help="tiny replicas on CPU (a check of the script)")
    args = p.parse_args(argv)
    if args.replicas is None:
        if args.tiny:
            args.replicas = 2
        else:
            import torch

            args.replicas = torch.cuda.device_count()
    if args.replicas < 1:
        p.error(f"--replicas {args.replicas}: at least 1 (no GPU here? --tiny runs on CPU)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    reports = run_replicas(args, out)
    results = {"model": "tiny" if args.tiny else args.model, "replicas": args.replicas, "out": str(out),
               "replicas_runs": reports, "aggregate": aggregate(reports)}
    (out / "data_parallel.json").write_text(json.dumps(results, indent=1))
    print_table(results)
    return results


if __name__ == "__main__":
    main()
