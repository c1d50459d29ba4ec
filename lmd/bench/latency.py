"""Latency at fixed lengths: for each batch size, `warmup` untimed then `iters` timed iterations of one batch.

An iteration submits `batch_size` fresh random prompts of exactly `input_len` tokens together, each generating
exactly `output_len` tokens (EOS ignored, greedy), and waits for all of them. Fresh prompts each iteration keep the
prefix cache from shortening later prefills. TTFT counts from the moment the batch was submitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmd.bench.sampling import BenchRequest, random_requests
from lmd.bench.stats import Summary, summarize
from lmd.bench.throughput import counter_growth
from lmd.bench.timeline import Clock, Timeline, generation_config, read_timeline
from lmd.bench.workload import engine_codec
from lmd.errors import LmdError

if TYPE_CHECKING:
    from lmd.turbomind.engine import Engine


@dataclass(frozen=True)
class LatencyConfig:
    input_len: int = 128
    output_len: int = 128
    batch_sizes: tuple[int, ...] = (1,)
    warmup: int = 1
    iters: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for flag, value, low in (
            ("--input-len", self.input_len, 1),
            ("--output-len", self.output_len, 1),
            ("--warmup", self.warmup, 0),
            ("--iters", self.iters, 1),
        ):
            if value < low:
                raise LmdError(f"{flag} must be at least {low} (got {value})")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise LmdError(f"--batch-size values must be at least 1 (got {list(self.batch_sizes)})")


@dataclass(frozen=True)
class BatchLatency:
    batch_size: int
    iterations: list[list[Timeline]]  # the timed iterations, each a batch of timelines
    iteration_s: list[float]  # wall time of each timed iteration, submission to the last token
    engine_counters: dict[str, int]  # growth of EngineStats counters over the timed iterations

    @property
    def timelines(self) -> list[Timeline]:
        return [t for batch in self.iterations for t in batch]

    @property
    def output_tokens(self) -> int:
        return sum(t.output_len for t in self.timelines)

    def ttft(self) -> Summary | None:
        return summarize([t.ttft for t in self.timelines if t.ttft is not None])

    def decode_per_token(self) -> Summary | None:
        """Per request: the mean interval between its tokens after the first (one decode step of the batch)."""
        return summarize([t.tpot for t in self.timelines if t.tpot is not None])

    def inter_token(self) -> Summary | None:
        """Every interval between consecutive tokens of a request, pooled over requests and iterations."""
        return summarize([gap for t in self.timelines for gap in t.inter_token])

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over wall time, prefill included."""
        total = sum(self.iteration_s)
        return self.output_tokens / total if total > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens the batch generates per second while decoding: batch_size / mean decode interval."""
        decode = self.decode_per_token()
        return self.batch_size / decode.mean if decode is not None and decode.mean > 0 else None


def check_fits(config: LatencyConfig, max_len: int, max_batch_size: int) -> None:
    if config.input_len + config.output_len > max_len:
        raise LmdError(
            f"--input-len {config.input_len} + --output-len {config.output_len} exceeds the engine's "
            f"{max_len} tokens per session; shorten them or raise --session-len"
        )
    if max(config.batch_sizes) > max_batch_size:
        raise LmdError(
            f"--batch-size {max(config.batch_sizes)} exceeds the engine's max_batch_size {max_batch_size};"
            " raise --max-batch-size"
        )


def run_latency(
    engine: Engine,
    config: LatencyConfig,
    on_iteration: Callable[[], None] | None = None,
    clock: Clock = time.perf_counter,
) -> list[BatchLatency]:
    check_fits(config, engine.max_len, engine.workspace.engine.max_batch_size)
    vocab, banned = engine_codec(engine).random_space()
    results, draw = [], config.seed
    for batch_size in config.batch_sizes:
        timed: list[list[Timeline]] = []
        walls: list[float] = []
        before = None
        for i in range(config.warmup + config.iters):
            if i == config.warmup:
                before = engine.stats()
            requests = random_requests(batch_size, config.input_len, config.output_len, vocab, draw, banned)
            draw += 1
            start = clock()
            batch = asyncio.run(_one_batch(engine, requests, start, clock))
            wall = max(t.finished for t in batch) - start
            _check_exact(batch, config.output_len, engine)
            if i >= config.warmup:
                timed.append(batch)
                walls.append(wall)
            if on_iteration is not None:
                on_iteration()
        assert before is not None
        results.append(BatchLatency(batch_size, timed, walls, counter_growth(before, engine.stats())))
    return results


async def _one_batch(engine: Engine, requests: list[BenchRequest], start: float, clock: Clock) -> list[Timeline]:
    configs = [generation_config(r) for r in requests]
    # Engine.generate and the engine thread's inbox drain share engine._cv (a re-entrant Condition): holding it while
    # submitting makes the whole batch arrive in the same step, as one batched generate call would.
    with getattr(engine, "_cv", None) or contextlib.nullcontext():
        streams = [engine.generate(list(r.prompt_ids), c) for r, c in zip(requests, configs, strict=True)]
    return list(
        await asyncio.gather(*(read_timeline(s, r, start, clock) for s, r in zip(streams, requests, strict=True)))
    )


def _check_exact(batch: list[Timeline], output_len: int, engine: Engine) -> None:
    short = [t for t in batch if t.output_len != output_len]
    if short:
        why = f": {engine.last_error}" if engine.last_error is not None else ""
        raise LmdError(
            f"a request returned {short[0].output_len} of {output_len} tokens (finish_reason "
            f"'{short[0].finish_reason}'){why}; rerun with LMD_DEBUG=1"
        )
