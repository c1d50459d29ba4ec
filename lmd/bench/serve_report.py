"""`lmd bench serve` results: one JSON object (`--json`, `--save-result`) with a run per concurrency limit, and the
rich table of them side by side. Keys follow `lmd bench throughput`'s report where the metric is the same."""

from __future__ import annotations

from typing import Any

from lmd.bench.report import fmt, ms_summary, stat
from lmd.bench.serve_run import ServeRun

SERVE = "serve"


def serve_run_report(run: ServeRun, request_rate: float | None) -> dict[str, Any]:
    """`request_rate`: as the settings record it, None for inf (all at once)."""
    done = run.completed
    return {
        "concurrency": run.max_concurrency,  # None: no limit
        "request_rate": request_rate,
        "requests": len(run.records),
        "completed": len(done),
        "failed": len(run.records) - len(done),
        "errors": run.errors,
        "max_in_flight": run.max_in_flight,
        "total_s": run.total_s,
        "requests_per_s": run.per_s(len(done)),
        "input_tokens": run.input_tokens,
        "output_tokens": run.output_tokens,
        "input_tokens_per_s": run.per_s(run.input_tokens),
        "output_tokens_per_s": run.per_s(run.output_tokens),
        "total_tokens_per_s": run.per_s(run.input_tokens + run.output_tokens),
        "cached_tokens": sum(r.cached_tokens for r in done),
        "usage_reported": sum(r.usage_reported for r in done),
        "ttft_ms": ms_summary(run.ttft()),
        "tpot_ms": ms_summary(run.tpot()),
        "itl_ms": ms_summary(run.inter_token()),
        "latency_ms": ms_summary(run.latency()),
    }


def serve_report(runs: list[ServeRun], settings: dict[str, Any], label: str) -> dict[str, Any]:
    return {
        "benchmark": SERVE,
        "label": label,
        "settings": settings,
        "runs": [serve_run_report(r, settings["request_rate"]) for r in runs],
    }


def _limit(run: dict[str, Any]) -> str:
    return "no limit" if run["concurrency"] is None else str(run["concurrency"])


def serve_rows(report: dict[str, Any]) -> list[tuple[str, list[str]]]:
    runs = report["runs"]
    rows: list[tuple[str, list[str]]] = [
        ("requests: completed / failed", [f"{r['completed']} / {r['failed']}" for r in runs]),
        ("max in flight", [str(r["max_in_flight"]) for r in runs]),
        ("duration s", [fmt(r["total_s"], 2) for r in runs]),
        ("requests/s", [fmt(r["requests_per_s"], 3) for r in runs]),
        ("input tok/s", [f"{fmt(r['input_tokens_per_s'])} ({r['input_tokens']:,})" for r in runs]),
        ("output tok/s", [f"{fmt(r['output_tokens_per_s'])} ({r['output_tokens']:,})" for r in runs]),
        ("total tok/s", [fmt(r["total_tokens_per_s"]) for r in runs]),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("latency_ms", "E2E latency")):
        rows.append(
            (
                f"{name} ms mean / p50 / p99",
                [" / ".join(fmt(stat(r, key, f), 2) for f in ("mean", "median", "p99")) for r in runs],
            )
        )
    rows.append(("prefix-cached prompt tokens", [f"{r['cached_tokens']:,}" for r in runs]))
    return rows


def print_serve(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s = report["settings"]
    rate = "inf" if s["request_rate"] is None else f"{s['request_rate']:g}/s"
    table = Table(title=f"lmd bench serve: {s['model']} at {s['url']}{s['endpoint']}, {s['dataset']}, rate {rate}")
    table.add_column("max concurrency", style="bold")
    for run in report["runs"]:
        table.add_column(_limit(run), justify="right")
    for metric, values in serve_rows(report):
        table.add_row(metric, *values)
    console = Console()
    console.print(table)
    for run in report["runs"]:
        if run["completed"] > run["usage_reported"]:
            console.print(
                f"concurrency {_limit(run)}: {run['completed'] - run['usage_reported']} replies came without usage; "
                "their output tokens are counted as text chunks",
                style="yellow",
            )
        for error, count in run["errors"].items():
            console.print(f"concurrency {_limit(run)}: {count} failed: {error}", style="red")
