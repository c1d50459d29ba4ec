"""`lmd calibrate MODEL`: per-channel activation stats and per-head KV stats into a work dir (LMDeploy layout)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from lmd.lite.calibrate import CalibrateResult, LayerCallback


def calibrate_command(
    model: str = typer.Argument(..., help="HF model directory, .gguf file or hub id."),
    calib_dataset: str = typer.Option("c4", "--calib-dataset",
                                      help="c4, ptb, wikitext2, pileval, pydoc, or a path (.txt/.raw/.jsonl/.json/"
                                           ".parquet or a directory of them)."),
    calib_samples: int = typer.Option(128, "--calib-samples", help="Number of calibration windows."),
    calib_seqlen: int = typer.Option(2048, "--calib-seqlen", help="Tokens per calibration window."),
    calib_split: str | None = typer.Option(None, "--calib-split",
                                           help="Dataset split (default: train; validation for pileval)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the window sampler."),
    work_dir: str = typer.Option("./work_dir", "--work-dir", help="Output directory for the *_stats.pth files."),
    device: str = typer.Option("cpu", "--device", help="Compute device (cpu or cuda); one decoder layer at a time."),
    dtype: str = typer.Option("auto", "--dtype",
                              help="Model dtype: auto (float32 on cpu, float16 on cuda), float32, float16, bfloat16."),
    batch_size: int = typer.Option(1, "--batch-size", help="Samples per forward pass of one layer."),
    data_dir: str | None = typer.Option(None, "--data-dir",
                                        help="Local data mirror laid out like ../shared/data (default $LMD_DATA_DIR)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty existing --work-dir."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON instead of a table."),
) -> None:
    """Collect activation and KV-cache statistics on a calibration set (input to `lmd kv-qparams`)."""
    from lmd.lite.calibrate import CalibrateConfig, calibrate

    cfg = CalibrateConfig(model=model, work_dir=work_dir, calib_dataset=calib_dataset, calib_samples=calib_samples,
                          calib_seqlen=calib_seqlen, calib_split=calib_split, seed=seed, device=device, dtype=dtype,
                          batch_size=batch_size, data_dir=data_dir, force=force)
    with _layer_progress(enabled=not json_out) as on_layer:
        result = calibrate(cfg, on_layer)
    if json_out:
        typer.echo(json.dumps(result.to_json()))
    else:
        _print_table(result)


@contextmanager
def _layer_progress(enabled: bool) -> Iterator[LayerCallback | None]:
    """A transient rich bar on stderr advancing once per decoder layer (plain lines when stderr is a log file)."""
    if not enabled:
        yield None
        return
    import time

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    bar = Progress(TextColumn("calibrating layers"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=True)
    task: list[int] = []
    start = time.perf_counter()

    def on_layer(done: int, total: int) -> None:
        if not console.is_terminal:
            if done:
                console.print(f"calibrated layer {done}/{total} ({time.perf_counter() - start:.0f} s)")
            return
        if not task:
            bar.start()
            task.append(bar.add_task("layers", total=total))
        bar.update(task[0], completed=done)

    try:
        yield on_layer
    finally:
        bar.stop()


def _print_table(result: CalibrateResult) -> None:
    from rich.console import Console
    from rich.table import Table

    from lmd.lite.calibrate import CALIB_JSON, STATS_FILES

    table = Table(title="calibration", caption=f"wrote {', '.join(STATS_FILES)}, {CALIB_JSON}")
    table.add_column("")
    table.add_column("value")
    rows = {"model": result.model, "data": f"{result.dataset} ({result.split}): {result.source}",
            "samples × seqlen": f"{result.samples} × {result.seqlen}", "seed": str(result.seed),
            "layers": str(result.num_layers), "heads / kv heads × head dim":
            f"{result.num_heads} / {result.kv_heads} × {result.head_dim}",
            "device": f"{result.device} ({result.dtype})", "seconds": f"{result.seconds:.1f}",
            "work dir": result.work_dir}
    for key, value in rows.items():
        table.add_row(key, value)
    Console().print(table)
