"""The accuracy line of `lmd awq`'s quality report: zero-shot accuracy of the model in memory (float before the
quantization, fake-quantized after it) on the first items of a few tasks, scored by `lmd eval tasks`' own code
(lm-eval's rules, `lmd.eval.tasks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmd.errors import LmdError

DEFAULT_TASKS = "arc_easy,piqa"
DEFAULT_ITEMS = 200


@dataclass(frozen=True)
class AccuracyProbe:
    """The task sets, loaded (and so checked) before anything slow runs."""

    sets: tuple[Any, ...]  # lmd.eval.tasks.formats.TaskSet
    items: int

    @property
    def requests(self) -> int:
        return sum(len(item.requests) for s in self.sets for item in s.items)


def load_probe(tasks: str, items: int, data_dir: str | None) -> AccuracyProbe:
    from lmd.eval.tasks.formats import load_task, parse_tasks

    if items < 1:
        raise LmdError(f"--eval-items {items} must be at least 1 (or turn the report off with --no-eval)")
    names = parse_tasks(tasks)
    return AccuracyProbe(tuple(load_task(name, data_dir, items) for name in names), items)


def accuracy(lm: Any, tokenizer: Any, probe: AccuracyProbe, device: str, label: str, quiet: bool) -> dict[str, float]:
    """{task: acc} of `lm` (left on the CPU afterwards, as the caller keeps it)."""
    from lmd.eval.tasks.backends import HfBackend
    from lmd.eval.tasks.scoring import score_task

    lm.to(device)
    try:
        backend = HfBackend(lm, tokenizer, label, device)
        with _bar(not quiet, probe.requests, label) as advance:
            return {s.task: score_task(s, backend, advance).acc for s in probe.sets}
    finally:
        lm.to("cpu")


def _bar(enabled: bool, total: int, label: str):
    from contextlib import contextmanager, nullcontext

    if not enabled:
        return nullcontext(lambda n: None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    @contextmanager
    def bar():
        with Progress(TextColumn(f"accuracy ({label})"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("requests", total=total)
            yield lambda n: progress.update(task, advance=n)

    return bar()


def accuracy_row(fp: dict[str, float] | None, q: dict[str, float]) -> str:
    """'arc_easy 49.0 -> 48.5 (-0.5), piqa ...' (percent); without the float run only the int4 figures."""
    parts = []
    for task, acc in q.items():
        if fp is None:
            parts.append(f"{task} {100 * acc:.1f}")
        else:
            parts.append(f"{task} {100 * fp[task]:.1f} -> {100 * acc:.1f} ({100 * (acc - fp[task]):+.1f})")
    if fp is not None and len(q) > 1:
        parts.append(f"mean {100 * sum(q[t] - fp[t] for t in q) / len(q):+.1f}")
    return ", ".join(parts)
