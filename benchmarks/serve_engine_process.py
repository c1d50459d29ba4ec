"""`lmd serve` end to end over HTTP, the engine in its own process (the default) against the engine on a thread of
the server's process (`--disable-frontend-multiprocessing`), on one GPU (issue 14, deliverable 2).

    python3 benchmarks/serve_engine_process.py [--wheels .peers/serve-wheels] [--levels 1:16,64:1000,256:1000]
        [--rounds 2]
    python3 benchmarks/serve_engine_process.py --tiny      # a tiny model on CPU: every step of the script, quickly

A random-weight Llama-2-7B-shaped fp16 workspace (built as benchmarks/engine.py builds it); for each round and each
mode a fresh `lmd serve` process, then `lmd bench serve` (another process: streamed /v1/completions, random 128-token
prompts, exactly 128 output tokens) once per --levels entry CONCURRENCY:REQUESTS; modes alternate between rounds so
drift hits both.
`--wheels`: a directory of fastapi/uvicorn/httpx wheels installed first when fastapi is missing (the GPU machine has
none). Writes $OUT/serve_engine_process.json (or ./) and prints a table last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLAMA2_7B, TINY, build_workspace  # noqa: E402

from lmd.bench.report import stat  # noqa: E402

MODES = {"process": [], "thread": ["--disable-frontend-multiprocessing"]}


def install_wheels(wheels: Path | None) -> None:
    if importlib.util.find_spec("fastapi") is not None:
        return
    if wheels is None:
        sys.exit("fastapi is not installed; pass --wheels DIR (fastapi, uvicorn, httpx and their dependencies)")
    finds = [str(wheels)] + [str(p) for p in wheels.parent.glob("*/wheels")]  # pydantic comes with the peers' wheels
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", *sum((["--find-links", f] for f in finds), []),
           "fastapi", "uvicorn", "httpx"]
    subprocess.run(cmd, check=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(ws: Path, mode: str, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "lmd", "serve", str(ws), "--host", "127.0.0.1", "--port", str(port),
           "--max-batch-size", str(args.max_batch_size), "--log-level", "warning", "--device", args.device,
           *MODES[mode]]
    start = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import httpx

    while True:
        if server.poll() is not None:
            sys.exit(f"lmd serve ({mode}) exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url, time.perf_counter() - start
        except httpx.TransportError:
            pass
        if time.perf_counter() - start > 600:
            server.kill()
            sys.exit(f"lmd serve ({mode}) did not answer within 600 s")
        time.sleep(0.2)


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def bench(url: str, ws: Path, args: argparse.Namespace, concurrency: int, requests: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "lmd", "bench", "serve", url, "--tokenizer", str(ws), "--dataset", "random",
           "--random-input-len", str(args.input_len), "--fixed-output-len", str(args.output_len),
           "--num-prompts", str(requests), "--max-concurrency", str(concurrency), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"lmd bench serve failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(run: dict[str, Any]) -> dict[str, Any]:
    """The figures of one concurrency level (lmd bench serve's report keys)."""
    out = {"max_concurrency": run["concurrency"], "completed": run["completed"], "failed": run["failed"],
           "total_s": run["total_s"], "requests_per_s": run["requests_per_s"],
           "output_throughput": run["output_tokens_per_s"]}
    for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
        out[metric] = {k: stat(run, metric, k) for k in ("mean", "median", "p99")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU, few requests")
    p.add_argument("--wheels", type=Path, default=None)
    p.add_argument("--levels", default="1:16,64:1000,256:1000", help="CONCURRENCY:REQUESTS comma list")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    install_wheels(args.wheels)
    if args.tiny:
        args.device, shape = "cpu", TINY
        args.levels, args.rounds, args.output_len = "1:2,4:8", 1, 8
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device; use --tiny on CPU")
        args.device, shape = "cuda", LLAMA2_7B
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lmd-serve-bench-"))
    results: dict[str, Any] = {"settings": vars(args) | {"wheels": str(args.wheels)}, "runs": []}
    try:
        t0 = time.perf_counter()
        ws = build_workspace(tmp / "ws", shape, int4=False, session_len=2048, device=torch.device(args.device))
        print(f"workspace built in {time.perf_counter() - t0:.1f} s", flush=True)
        for round_ in range(args.rounds):
            for mode in (MODES if round_ % 2 == 0 else reversed(list(MODES))):
                log = out_dir / f"serve_{mode}_{round_}.log"
                server, url, started = start_server(ws, mode, args, log)
                try:
                    runs = [row(bench(url, ws, args, int(c), int(n))["runs"][0])
                            for c, n in (level.split(":") for level in args.levels.split(","))]
                finally:
                    stop_server(server)
                results["runs"].append({"mode": mode, "round": round_, "start_s": started, "levels": runs})
                print(f"{mode} round {round_}: started in {started:.1f} s; "
                      + "; ".join(f"c={r['max_concurrency']}: {r['output_throughput']:.0f} tok/s, "
                                  f"TPOT {r['tpot_ms']['mean']:.2f} ms" for r in runs), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (out_dir / "serve_engine_process.json").write_text(json.dumps(results, indent=1))
    print("\nmode     round  concurrency  output tok/s  mean TPOT ms  p99 ITL ms  mean TTFT ms")
    for run in results["runs"]:
        for r in run["levels"]:
            print(f"{run['mode']:<8} {run['round']:>5}  {r['max_concurrency']!s:>11}  {r['output_throughput']:>12.1f}"
                  f"  {r['tpot_ms']['mean']:>12.2f}  {r['itl_ms']['p99']:>10.2f}  {r['ttft_ms']['mean']:>12.1f}")


if __name__ == "__main__":
    main()
