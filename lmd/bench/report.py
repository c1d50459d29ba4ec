"""Benchmark results as JSON-ready dicts (`--json`, benchmarks/engine.py) and as rich tables.

Times in reports are milliseconds (`*_ms`) or seconds (`*_s`); every summary holds count, mean, median, p90, p99,
min and max. A summary with no samples (e.g. TPOT when every request produced one token) is null.
"""

from __future__ import annotations

from typing import Any

from lmd.bench.latency import BatchLatency
from lmd.bench.stats import Summary
from lmd.bench.throughput import ThroughputRun

SUMMARY_KEYS = ("count", "mean", "median", "p90", "p99", "min", "max")


def ms_summary(summary: Summary | None) -> dict[str, float] | None:
    return None if summary is None else summary.scaled(1000.0).to_dict()


def throughput_report(run: ThroughputRun, settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "benchmark": "throughput",
        "settings": settings,
        "requests": len(run.timelines),
        "concurrency": run.concurrency,
        "max_in_flight": run.max_in_flight,
        "total_s": run.total_s,
        "requests_per_s": run.per_s(len(run.timelines)),
        "input_tokens": run.input_tokens,
        "output_tokens": run.output_tokens,
        "input_tokens_per_s": run.per_s(run.input_tokens),
        "output_tokens_per_s": run.per_s(run.output_tokens),
        "total_tokens_per_s": run.per_s(run.input_tokens + run.output_tokens),
        "ttft_ms": ms_summary(run.ttft()),
        "tpot_ms": ms_summary(run.tpot()),
        "latency_ms": ms_summary(run.latency()),
        "finish_reasons": run.finish_reasons,
        "engine": dict(run.engine_counters),
    }


def throughput_sweep_report(runs: list[ThroughputRun], settings: dict[str, Any], label: str) -> dict[str, Any]:
    """One run: `throughput_report`, as it is (no label). Several (a --concurrency list): one object holding each
    run's `throughput_report` in order, under the label that --plot and --baseline use."""
    reports = [throughput_report(run, settings) for run in runs]
    if len(reports) == 1:
        return reports[0]
    return {"benchmark": "throughput", "label": label, "settings": settings, "runs": reports}


def latency_report(results: list[BatchLatency], settings: dict[str, Any]) -> dict[str, Any]:
    batches = []
    for r in results:
        batches.append(
            {
                "batch_size": r.batch_size,
                "iterations": len(r.iterations),
                "output_tokens": r.output_tokens,
                "iteration_s": list(r.iteration_s),
                "ttft_ms": ms_summary(r.ttft()),
                "decode_ms_per_token": ms_summary(r.decode_per_token()),
                "inter_token_ms": ms_summary(r.inter_token()),
                "tokens_per_s": r.tokens_per_s,
                "decode_tokens_per_s": r.decode_tokens_per_s,
                "engine": dict(r.engine_counters),
            }
        )
    return {"benchmark": "latency", "settings": settings, "batches": batches}


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def stat(report: dict[str, Any], key: str, field: str) -> float | None:
    summary = report[key]
    return None if summary is None else summary[field]


def throughput_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    settings = report["settings"]
    engine = report["engine"]
    rows = [
        ("model", str(settings.get("model", "-"))),
        ("dataset", str(settings.get("dataset", "-"))),
        ("requests / concurrency", f"{report['requests']} / {report['concurrency']}"),
        ("total time", f"{report['total_s']:.2f} s"),
        ("requests/s", fmt(report["requests_per_s"], 3)),
        ("input tokens/s", f"{fmt(report['input_tokens_per_s'])} ({report['input_tokens']:,} tokens)"),
        ("output tokens/s", f"{fmt(report['output_tokens_per_s'])} ({report['output_tokens']:,} tokens)"),
    ]
    for key, label in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("latency_ms", "request latency ms")):
        rows.append(
            (
                f"{label} mean / median / p99",
                " / ".join(fmt(stat(report, key, f), 2) for f in ("mean", "median", "p99")),
            )
        )
    rows += [
        ("preemptions", str(engine["preemptions"])),
        ("prefix-hit tokens", f"{engine['prefix_hit_tokens']:,}"),
        ("finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(report["finish_reasons"].items()))),
    ]
    speculative = speculative_summary(engine)
    if speculative is not None:
        rows.append(("speculative accepted / proposed", speculative))
    return rows


def speculative_summary(engine: dict[str, Any]) -> str | None:
    """Accepted / proposed tokens, the rate and the mean accepted length (tokens per verification, the target's own
    included) of a run's engine counters; None when nothing was verified."""
    verifications = engine.get("spec_verifications", 0)
    if not verifications:
        return None
    accepted, proposed = engine["spec_accepted_tokens"], engine["spec_proposed_tokens"]
    return (f"{accepted:,} / {proposed:,} ({accepted / proposed:.0%}), mean accepted length "
            f"{1 + accepted / verifications:.2f}")


def print_throughput(report: dict[str, Any]) -> None:
    """One run: metric / value; a sweep: a column per concurrency value."""
    from rich.console import Console
    from rich.table import Table

    runs = report.get("runs", [report])
    sweep = len(runs) > 1
    table = Table(title="lmd bench throughput", show_header=sweep)
    table.add_column("metric", style="bold")
    for run in runs:
        table.add_column(f"concurrency {run['concurrency']}" if sweep else "value", overflow="fold")
    columns = [throughput_rows(run) for run in runs]
    for i, (metric, _) in enumerate(columns[0]):
        table.add_row(metric, *(rows[i][1] for rows in columns))
    Console().print(table)


def print_latency(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s = report["settings"]
    table = Table(
        title=f"lmd bench latency: {s.get('model', '-')}, {s['input_len']} in / {s['output_len']} out, {s['iters']} iters"
    )
    for header in (
        "batch",
        "TTFT ms",
        "TTFT p99",
        "decode ms/tok",
        "ITL p50",
        "ITL p99",
        "tok/s",
        "decode tok/s",
        "preempt",
    ):
        table.add_column(header, justify="right")
    for b in report["batches"]:
        table.add_row(
            str(b["batch_size"]),
            fmt(stat(b, "ttft_ms", "mean"), 2),
            fmt(stat(b, "ttft_ms", "p99"), 2),
            fmt(stat(b, "decode_ms_per_token", "mean"), 2),
            fmt(stat(b, "inter_token_ms", "median"), 2),
            fmt(stat(b, "inter_token_ms", "p99"), 2),
            fmt(b["tokens_per_s"]),
            fmt(b["decode_tokens_per_s"]),
            str(b["engine"]["preemptions"]),
        )
    Console().print(table)
    Console().print(
        "times in ms; ITL: interval between consecutive tokens of a request; tok/s: generated tokens "
        "over wall time, prefill included",
        style="dim",
    )
