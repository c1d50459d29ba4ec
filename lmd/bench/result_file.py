"""Result files: lmd's own (`--save-result`, `--json`), read back as plot series beside other servers' results.

A file may hold an lmd sweep (`{"label", "runs": [...]}`), one lmd throughput report, a vLLM `--save-result` object
(`output_throughput`, `median_ttft_ms`, `p99_ttft_ms`, ..., `max_concurrency`), or SGLang's JSON lines of such
objects. Each run is one point; a run without a concurrency limit sits at its number of requests (all in flight).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmd.errors import LmdError


@dataclass(frozen=True)
class Point:
    concurrency: int
    output_tokens_per_s: float
    ttft_p50_ms: float  # nan where the file has no value
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float


@dataclass(frozen=True)
class Series:
    label: str
    points: tuple[Point, ...]  # by concurrency


def check_new_file(path: str, force: bool, flag: str, suffixes: tuple[str, ...]) -> Path:
    """Fail before any work when `path` cannot be written: wrong suffix, missing folder, or taken without --force."""
    target = Path(path).expanduser()
    if target.suffix.lower() not in suffixes:
        raise LmdError(f"{flag} {path}: give a file name ending in {', '.join(suffixes)}")
    if target.is_dir():
        raise LmdError(f"{flag} {path} is a directory; give a file name")
    if target.exists() and not force:
        raise LmdError(f"{flag} {path} already exists; pass --force to overwrite it or choose another name")
    if not target.resolve().parent.is_dir():
        raise LmdError(f"{flag} {path}: the folder {target.resolve().parent} does not exist; create it first")
    return target


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Written beside `path` and renamed onto it when complete, so a reader never sees half a file."""
    from lmd.lite.output_dir import atomic_output_file

    with atomic_output_file(path) as tmp:
        tmp.write_text(json.dumps(report, indent=1) + "\n")


def series_of(report: dict[str, Any], label: str) -> Series:
    """The points of one of lmd's reports (a sweep or a single throughput run)."""
    return Series(label, tuple(sorted((_point(r) for r in _runs(report)), key=lambda p: p.concurrency)))


def read_baseline(spec: str) -> Series:
    """`[LABEL=]PATH`: the series of a result file, labelled LABEL, else the file's own label, else its name."""
    label, _, path = spec.partition("=") if "=" in spec and not Path(spec).exists() else ("", "", spec)
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LmdError(f"--baseline {spec}: cannot read {file} ({exc}); give a result JSON file") from None
    rows = _json_rows(text, spec)
    own = rows[0].get("label") if len(rows) == 1 else None
    name = label or (own if isinstance(own, str) and own else file.stem)
    runs = [run for row in rows for run in _runs(row)]
    try:
        points = sorted((_point(r) for r in runs), key=lambda p: p.concurrency)
    except (KeyError, TypeError, ValueError) as exc:
        raise LmdError(
            f"--baseline {spec}: a run lacks {exc}; expected an lmd result or a vLLM/SGLang bench result"
        ) from None
    return Series(name, tuple(points))


def merge_series(series: list[Series]) -> list[Series]:
    """One series per label, in first-seen order (e.g. a vLLM result file per concurrency level)."""
    merged: dict[str, list[Point]] = {}
    for s in series:
        merged.setdefault(s.label, []).extend(s.points)
    return [Series(k, tuple(sorted(v, key=lambda p: p.concurrency))) for k, v in merged.items()]


def _json_rows(text: str, spec: str) -> list[dict[str, Any]]:
    try:
        data: Any = json.loads(text)
        rows = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise LmdError(f"--baseline {spec}: not JSON or JSON lines ({exc.msg} at line {exc.lineno})") from None
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise LmdError(f"--baseline {spec}: expected a JSON object (or JSON lines of them) per run")
    return rows


def _runs(row: dict[str, Any]) -> list[dict[str, Any]]:
    runs = row.get("runs")
    return runs if isinstance(runs, list) else [row]


def _point(run: dict[str, Any]) -> Point:
    if "output_tokens_per_s" in run:  # lmd: summaries in *_ms objects
        limit, everyone = run.get("concurrency"), run.get("requests")
        return Point(
            int(limit if limit is not None else everyone),
            float(run["output_tokens_per_s"]),
            *(_stat(run.get(key), field) for key in ("ttft_ms", "tpot_ms") for field in ("median", "p99")),
        )
    limit, everyone = run.get("max_concurrency"), run.get("num_prompts", run.get("completed"))  # vLLM / SGLang
    return Point(
        int(limit if limit is not None else everyone),  # type: ignore[arg-type]
        float(run["output_throughput"]),
        *(_number(run.get(f"{q}_{m}_ms")) for m in ("ttft", "tpot") for q in ("median", "p99")),
    )


def _stat(summary: Any, field: str) -> float:
    return _number(summary.get(field)) if isinstance(summary, dict) else math.nan


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else math.nan
