"""Perplexity by the llm-awq/GPTQ protocol, independent of what computes the logits.

The token stream is cut into non-overlapping windows of `seqlen` tokens (the trailing partial window is dropped);
each window is scored on its own (no context carried over), predicting ids[1:] from their prefixes, so a window
contributes `seqlen - 1` predicted tokens. ppl = exp(total NLL / total predicted tokens). llm-awq writes this as
exp(sum(mean_loss_i * seqlen) / (windows * seqlen)), which is the same number: every window has the same count.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmd.errors import LmdError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PplResult:
    ppl: float
    nll: float  # mean NLL per predicted token, nats
    tokens: int  # predicted tokens = windows * (seqlen - 1)
    windows: int
    seconds: float
    dataset: str
    split: str
    seqlen: int


def perplexity(score_window: Callable[[torch.Tensor], float], input_ids: torch.Tensor, seqlen: int = 2048,
               max_windows: int | None = None, progress: bool = True, **labels: str) -> PplResult:
    """`score_window(ids [L])` returns the SUM of NLL (nats) of ids[1:] given their prefixes within the window."""
    if seqlen < 2:
        raise LmdError(f"--seqlen must be at least 2 (got {seqlen})")
    if max_windows is not None and max_windows < 1:
        raise LmdError(f"--max-windows must be at least 1 (got {max_windows})")
    ids = input_ids.reshape(-1)
    windows = ids.numel() // seqlen
    if max_windows is not None:
        windows = min(windows, max_windows)
    if windows == 0:
        raise LmdError(f"the evaluation text has {ids.numel()} tokens, fewer than one window of {seqlen}; "
                       "use a smaller --seqlen or a longer data set")
    start = time.perf_counter()
    total = 0.0
    with _progress(progress, windows) as advance:
        for i in range(windows):
            total += float(score_window(ids[i * seqlen:(i + 1) * seqlen]))
            advance(total / ((i + 1) * (seqlen - 1)))
    tokens = windows * (seqlen - 1)
    nll = total / tokens
    return PplResult(ppl=math.exp(nll), nll=nll, tokens=tokens, windows=windows,
                     seconds=time.perf_counter() - start, dataset=labels.get("dataset", ""),
                     split=labels.get("split", ""), seqlen=seqlen)


def hf_window_scorer(model, device: str = "cpu") -> Callable[[torch.Tensor], float]:
    """Score windows with an HF causal LM (logits in fp32 for the loss, whatever the model dtype)."""
    import torch
    import torch.nn.functional as F

    def score(ids: torch.Tensor) -> float:
        batch = ids.reshape(1, -1).to(device)
        with torch.inference_mode():
            logits = model(input_ids=batch, use_cache=False).logits[0, :-1].float()
            return float(F.cross_entropy(logits, batch[0, 1:], reduction="sum"))

    return score


@contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Callable[[float], None]]:
    """A transient rich progress bar on stderr showing the running ppl; silent when disabled."""
    if not enabled:
        yield lambda nll: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("perplexity"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[ppl]}"),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("ppl", total=total, ppl="")
        yield lambda nll: bar.update(task, advance=1, ppl=f"ppl {math.exp(nll):.3f}")
