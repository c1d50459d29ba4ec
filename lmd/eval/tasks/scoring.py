"""Scoring, independent of what computes the log-likelihoods.

A backend answers `loglikelihood(requests) -> [(sum_logprob, is_greedy)]` for a batch of (context, continuation)
strings. Tokenization follows lm-eval's HFLM rule (`encode_pair`): trailing whitespace of the context moves onto
the continuation, context and context+continuation are encoded without special tokens, and the continuation's
tokens are the tail of the whole encoding past the context's length. Metrics are lm-eval's: acc (argmax of the
summed log-likelihood), acc_norm (argmax of it divided by the choice's length in characters), the greedy match for
LAMBADA, each with the standard error of the mean (sample standard deviation / sqrt(n)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lmd.eval.tasks.formats import TaskSet

Request = tuple[str, str]


class Backend(Protocol):
    name: str

    def loglikelihood(self, requests: Sequence[Request],
                      advance: Callable[[int], None] = ...) -> list[tuple[float, bool]]: ...


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) by lm-eval's rule; an empty context becomes the EOS (or BOS) token."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        prefix = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
        return [prefix], tokenizer.encode(continuation, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


@dataclass(frozen=True)
class TaskResult:
    task: str
    items: int
    acc: float
    acc_stderr: float | None
    acc_norm: float | None
    acc_norm_stderr: float | None
    source: str
    ppl: float | None = None  # LAMBADA: exp(-mean log-likelihood of the target), as lm-eval reports


def mean_stderr(values: Sequence[float]) -> float | None:
    n = len(values)
    if n < 2:
        return None
    mu = sum(values) / n
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1) / n)


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])  # first maximum, like numpy.argmax


def score_task(task: TaskSet, backend: Backend, advance: Callable[[int], None] = lambda n: None) -> TaskResult:
    requests = [r for item in task.items for r in item.requests]
    answers = backend.loglikelihood(requests, advance)
    acc, acc_norm, lls = [], [], []
    pos = 0
    for item in task.items:
        got = answers[pos:pos + len(item.requests)]
        pos += len(item.requests)
        if task.greedy:
            acc.append(float(got[0][1]))
            lls.append(got[0][0])
            continue
        scores = [ll for ll, _ in got]
        acc.append(float(_argmax(scores) == item.gold))
        if item.choice_lengths is not None:
            normed = [ll / n_chars if n_chars else -math.inf  # numpy's -x/0 in lm-eval
                      for ll, n_chars in zip(scores, item.choice_lengths, strict=True)]
            acc_norm.append(float(_argmax(normed) == item.gold))
    n = len(task.items)
    return TaskResult(task.task, n, sum(acc) / n if n else math.nan, mean_stderr(acc),
                      sum(acc_norm) / n if acc_norm else None, mean_stderr(acc_norm) if acc_norm else None,
                      task.source, math.exp(-sum(lls) / n) if lls else None)
