"""`make demo`: the main job end to end on the embedded default model, offline.

SmolLM2-135M-Instruct (GGUF) → fp perplexity → `lmd awq` (int4, g64) → `lmd calibrate` → `lmd deploy` (awq) →
`lmd kv-qparams` → engine perplexity (int4 weights, int8 KV) → a chat reply through the engine. Every step runs the
real `lmd` CLI in a subprocess, exactly as a user would type it. Data come from $LMD_DATA_DIR (or the hub); when no data
set is reachable the demo says so and uses CPython's own documentation text (`pydoc`), and labels its figures with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


@dataclass(frozen=True)
class DemoData:
    eval_dataset: str
    calib_dataset: str


def pick_data() -> DemoData:
    from lmd.calib_data import load_eval_text
    from lmd.errors import LmdError

    try:
        load_eval_text("wikitext2", "test")
        eval_dataset = "wikitext2"
    except LmdError:
        console.print("[yellow]no WikiText-2 reachable (set LMD_DATA_DIR); evaluating on CPython's pydoc text[/]")
        eval_dataset = "pydoc"
    try:
        load_eval_text("c4", "train")
        calib_dataset = "c4"
    except LmdError:
        console.print("[yellow]no C4 reachable; calibrating on CPython's pydoc text[/]")
        calib_dataset = "pydoc"
    return DemoData(eval_dataset, calib_dataset)


def lmd(step: str, *args: str) -> dict:
    """Run one `lmd` command; return the JSON object it printed (--json)."""
    cmd = [sys.executable, "-m", "lmd", *args, "--json"]
    console.rule(f"[bold]{step}[/]: lmd {' '.join(args)}")
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"demo: step '{step}' failed (exit {proc.returncode}); command: {' '.join(cmd)}")
    result = json.loads(proc.stdout[proc.stdout.index("{"):]) if "{" in proc.stdout else {}
    result["_seconds"] = time.perf_counter() - start
    return result


def set_quant_policy(workspace: Path, policy: int) -> None:
    import configparser

    path = workspace / "triton_models" / "weights" / "config.ini"
    parser = configparser.ConfigParser()
    parser.read(path)
    parser["llama"]["quant_policy"] = str(policy)
    with open(path, "w") as f:
        parser.write(f)


def run_demo(out: Path, windows: int) -> None:
    from lmd.default_model import default_model_path

    out.mkdir(parents=True, exist_ok=True)
    model = str(default_model_path())
    data = pick_data()
    awq_dir, calib_dir, workspace = out / "smollm2-awq-g64", out / "calib", out / "workspace"
    ppl_args = ("--dataset", data.eval_dataset, "--seqlen", "1024", "--max-windows", str(windows))
    calib_args = ("--calib-dataset", data.calib_dataset)

    fp = lmd("fp32 perplexity", "eval", "ppl", model, *ppl_args)
    lmd("AWQ int4 g64", "awq", model, "--work-dir", str(awq_dir), "--w-group-size", "64", *calib_args,
        "--calib-samples", "32", "--calib-seqlen", "512", "--no-eval", "--force")
    awq_hf = lmd("int4 perplexity (transformers)", "eval", "ppl", str(awq_dir), *ppl_args)
    lmd("KV calibration", "calibrate", model, *calib_args, "--calib-samples", "16", "--calib-seqlen", "512",
        "--work-dir", str(calib_dir), "--force")
    lmd("deploy", "deploy", "hf", str(awq_dir), "--model-format", "awq", "--group-size", "64",
        "--dst-path", str(workspace), "--force")
    lmd("KV int8 params", "kv-qparams", str(calib_dir), str(workspace / "triton_models" / "weights"))
    engine = lmd("int4 perplexity (engine, fp KV)", "eval", "ppl", str(workspace), *ppl_args)
    set_quant_policy(workspace, 4)  # the hand edit LMDeploy users make to config.ini for an int8 KV cache
    engine_kv8 = lmd("int4 perplexity (engine, int8 KV)", "eval", "ppl", str(workspace), *ppl_args)

    from lmd.api import pipeline
    from lmd.turbomind.gen_config import GenerationConfig

    question = "What is the capital of France?"
    with pipeline(str(workspace)) as pipe:
        reply = pipe([question], GenerationConfig(max_new_tokens=48, temperature=0.0))[0].text

    table = Table(title=f"lmd demo — SmolLM2-135M-Instruct, {data.eval_dataset} ppl ({windows} × 1024 tokens)")
    table.add_column("model")
    table.add_column("runs on")
    table.add_column("ppl", justify="right")
    rows = [("fp32", "transformers", fp), ("AWQ int4 g64", "transformers", awq_hf),
            ("AWQ int4 g64", "lmd engine", engine), ("AWQ int4 g64 + KV int8", "lmd engine", engine_kv8)]
    for name, where, res in rows:
        table.add_row(name, where, f"{res['ppl']:.3f}")
    Console().print(table)
    Console().print(f"[bold]user:[/] {question}\n[bold]assistant:[/] {reply}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="folder for the demo's outputs")
    parser.add_argument("--windows", type=int, default=4, help="perplexity windows of 1024 tokens per evaluation")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    run_demo(args.out, args.windows)


if __name__ == "__main__":
    main()
