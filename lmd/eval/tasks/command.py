"""`lmd eval tasks MODEL --tasks arc_easy,...`: zero-shot accuracy by lm-eval's rules, through transformers for
HF / AWQ / GGUF models and through the engine for workspaces."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import typer

from lmd.errors import LmdError
from lmd.eval.tasks.formats import TASKS
from lmd.eval.tasks.scoring import Backend, TaskResult

DEFAULT_TASKS = "arc_easy,arc_challenge,piqa,hellaswag,winogrande,lambada"


def load_backend(model: str, device: str = "cpu", dtype: str = "float32") -> Backend:
    """Transformers for an HF directory / .gguf / hub id; the engine (started, serving loop on) for a workspace."""
    from lmd.eval.cli import ENGINE_DTYPES, load_hf_model
    from lmd.eval.tasks.backends import EngineBackend, HfBackend
    from lmd.turbomind.workspace import is_workspace

    if is_workspace(model):
        from lmd.turbomind.engine import Engine

        return EngineBackend(Engine(model, device=device, dtype=ENGINE_DTYPES[dtype]), f"{model} (engine)")
    name, _, tokenizer, lm = load_hf_model(model, device, dtype)
    return HfBackend(lm, tokenizer, name, device)


def tasks_command(
    model: str = typer.Argument(..., help="HF model directory, .gguf file, or an lmd workspace (run by the engine)."),
    tasks: str = typer.Option(DEFAULT_TASKS, "--tasks", help=f"Comma-separated: {', '.join(TASKS)}."),
    limit: int | None = typer.Option(None, "--limit", help="Score only the first N items of each task."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, float16 or bfloat16."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Local data mirror laid out like ../shared/data "
                                        "(default $LMD_DATA_DIR, else ../shared/data; the hub when a set is missing)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON instead of a table."),
) -> None:
    """Zero-shot accuracy with lm-evaluation-harness's rules (acc, acc_norm; LAMBADA last-word accuracy)."""
    from lmd.eval.cli import check_model_flags
    from lmd.eval.tasks.formats import load_task, parse_tasks
    from lmd.eval.tasks.scoring import score_task

    names = parse_tasks(tasks)
    if limit is not None and limit < 1:
        raise LmdError(f"--limit must be at least 1 (got {limit})")
    check_model_flags(model, device, dtype)
    sets = [load_task(name, data_dir, limit) for name in names]  # every data file is checked before the model loads
    backend = load_backend(model, device, dtype)
    start = time.perf_counter()
    try:
        with _progress(not json_out, sum(len(i.requests) for s in sets for i in s.items)) as advance:
            results = [score_task(s, backend, advance) for s in sets]
    finally:
        close = getattr(getattr(backend, "engine", None), "close", None)
        if close is not None:
            close()
    seconds = time.perf_counter() - start
    if json_out:
        typer.echo(json.dumps({"model": backend.name, "device": device, "dtype": dtype, "limit": limit,
                               "seconds": seconds, "tasks": [asdict(r) for r in results]}))
    else:
        _print_table(backend.name, results, seconds)


def _progress(enabled: bool, total: int):
    from contextlib import nullcontext

    if not enabled:
        return nullcontext(lambda n: None)
    from contextlib import contextmanager

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    @contextmanager
    def bar():
        with Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("tasks", total=total)
            yield lambda n: progress.update(task, advance=n)

    return bar()


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.2f}"


def _print_table(model: str, results: list[TaskResult], seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="zero-shot accuracy", caption=f"{model}, {seconds:.0f} s")
    for column in ("task", "items", "acc %", "± stderr", "acc_norm %", "± stderr"):
        table.add_column(column, justify="left" if column == "task" else "right")
    for r in results:
        table.add_row(r.task, str(r.items), _pct(r.acc), _pct(r.acc_stderr), _pct(r.acc_norm),
                      _pct(r.acc_norm_stderr))
    Console().print(table)
