"""The files a sweep writes besides its table: `--save-result` (JSON) and `--plot` (with `--baseline` series).

Everything is checked before the benchmark runs (names, existing files without `--force`, the baselines parse,
matplotlib is installed), so a run is never lost to a bad output flag at its end."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmd.bench.result_file import Series, check_new_file, merge_series, read_baseline, series_of, write_json
from lmd.errors import LmdError


@dataclass(frozen=True)
class OutputFiles:
    save_result: Path | None = None
    plot: Path | None = None
    baselines: tuple[Series, ...] = ()


def prepare_outputs(save_result: str | None, plot: str | None, baselines: list[str] | None, force: bool) -> OutputFiles:
    from lmd.bench.plot import PLOT_SUFFIXES

    if baselines and plot is None:
        raise LmdError("--baseline is drawn in the --plot figure; add --plot FILE.png")
    result = check_new_file(save_result, force, "--save-result", (".json",)) if save_result else None
    image = check_new_file(plot, force, "--plot", PLOT_SUFFIXES) if plot else None
    if image is not None and importlib.util.find_spec("matplotlib") is None:
        raise LmdError("--plot needs matplotlib; install it (pip install matplotlib) or leave --plot out")
    return OutputFiles(result, image, tuple(read_baseline(spec) for spec in baselines or ()))


def write_outputs(files: OutputFiles, report: dict[str, Any], label: str, title: str) -> None:
    """`report` (a sweep or one throughput run) to --save-result, and its series, named `label`, to --plot."""
    if files.save_result is not None:
        write_json(files.save_result, report)
    if files.plot is not None:
        from lmd.bench.plot import draw, save

        series = merge_series([series_of(report, label), *files.baselines])
        save(draw(series, title), files.plot)
