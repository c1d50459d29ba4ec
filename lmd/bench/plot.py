"""`--plot`: one figure, three panels against concurrency: output tok/s, TTFT p50/p99, TPOT p50/p99; a colour per
series (this run, then each baseline), p50 solid and p99 dashed. Drawn on matplotlib's Agg canvas, without pyplot,
so no GUI backend or global figure state is involved."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lmd.bench.result_file import Series

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def draw(series: list[Series], title: str) -> Figure:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 4.6), layout="constrained")
    throughput, ttft, tpot = figure.subplots(1, 3)
    colours = [f"C{i % 10}" for i in range(len(series))]
    for s, colour in zip(series, colours, strict=True):
        xs = [p.concurrency for p in s.points]
        throughput.plot(xs, [p.output_tokens_per_s for p in s.points], "o-", color=colour, label=s.label)
        for axes, p50, p99 in (
            (ttft, [p.ttft_p50_ms for p in s.points], [p.ttft_p99_ms for p in s.points]),
            (tpot, [p.tpot_p50_ms for p in s.points], [p.tpot_p99_ms for p in s.points]),
        ):
            axes.plot(xs, p50, "o-", color=colour, label=f"{s.label} p50")
            axes.plot(xs, p99, "x--", color=colour, label=f"{s.label} p99")
    every_x = sorted({p.concurrency for s in series for p in s.points})
    for axes, ylabel in ((throughput, "output tokens/s"), (ttft, "TTFT ms"), (tpot, "TPOT ms")):
        _concurrency_axis(axes, every_x)
        axes.set_ylabel(ylabel)
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="small")
    throughput.set_title("throughput")
    ttft.set_title("time to first token")
    tpot.set_title("time per output token")
    figure.suptitle(title)
    return figure


def save(figure: Figure, path: Path) -> None:
    """Rendered beside `path` and renamed onto it when complete."""
    from lmd.lite.output_dir import atomic_output_file

    with atomic_output_file(path) as tmp:
        figure.savefig(tmp, format=path.suffix.lstrip(".").lower(), dpi=120)


def _concurrency_axis(axes: Axes, xs: list[int]) -> None:
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    if len(xs) > 1 and xs[-1] / xs[0] >= 8:  # sweeps usually double; a log axis spaces them evenly
        axes.set_xscale("log", base=2)
        axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_xticks(xs)
    axes.xaxis.set_major_formatter(ScalarFormatter())
    axes.set_xlabel("max concurrency")
