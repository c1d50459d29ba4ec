"""Offline throughput: every request goes to the engine as soon as one of `concurrency` slots is free.

`concurrency` workers share one queue of requests; each submits a request, reads its stream to the end, then takes
the next. So at most `concurrency` requests are ever unfinished, and exactly that many while requests remain
(the engine's own `max_batch_size` may hold some of them in its waiting queue: that time counts as TTFT).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmd.bench.sampling import BenchRequest
from lmd.bench.stats import Summary, summarize
from lmd.bench.timeline import Clock, Timeline, generation_config, run_request
from lmd.errors import LmdError

if TYPE_CHECKING:
    from lmd.turbomind.engine import Engine, EngineStats

STAT_COUNTERS = ("prompt_tokens", "computed_tokens", "prefix_hit_tokens", "generated_tokens", "preemptions", "steps",
                 "spec_verifications", "spec_proposed_tokens", "spec_accepted_tokens")


@dataclass(frozen=True)
class ThroughputRun:
    timelines: list[Timeline]  # in request order
    total_s: float
    concurrency: int
    max_in_flight: int  # the most requests that were submitted and not yet finished at once
    engine_counters: dict[str, int]  # growth of EngineStats counters during the run (STAT_COUNTERS)

    @property
    def input_tokens(self) -> int:
        return sum(t.prompt_len for t in self.timelines)

    @property
    def output_tokens(self) -> int:
        return sum(t.output_len for t in self.timelines)

    @property
    def finish_reasons(self) -> dict[str, int]:
        return dict(Counter(t.finish_reason for t in self.timelines))

    def per_s(self, amount: float) -> float:
        return amount / self.total_s if self.total_s > 0 else 0.0

    def ttft(self) -> Summary | None:
        return summarize([t.ttft for t in self.timelines if t.ttft is not None])

    def tpot(self) -> Summary | None:
        return summarize([t.tpot for t in self.timelines if t.tpot is not None])

    def latency(self) -> Summary | None:
        return summarize([t.latency for t in self.timelines])


def counter_growth(before: EngineStats, after: EngineStats) -> dict[str, int]:
    return {name: getattr(after, name) - getattr(before, name) for name in STAT_COUNTERS}


def run_throughput(
    engine: Engine,
    requests: Sequence[BenchRequest],
    concurrency: int,
    temperature: float = 0.0,
    seed: int = 0,
    on_done: Callable[[Timeline], None] | None = None,
    clock: Clock = time.perf_counter,
) -> ThroughputRun:
    """Run every request through a started engine; `on_done` sees each timeline as its request finishes."""
    if concurrency < 1:
        raise LmdError(f"--concurrency must be at least 1 (got {concurrency})")
    if not requests:
        raise LmdError("no requests to run; raise --num-prompts")
    before = engine.stats()
    start = clock()
    timelines, max_in_flight = asyncio.run(_run_all(engine, requests, concurrency, temperature, seed, on_done, clock))
    total = clock() - start
    failed = [t for t in timelines if t.finish_reason in ("error", "abort")]
    if failed:
        why = f": {engine.last_error}" if engine.last_error is not None else ""
        raise LmdError(
            f"{len(failed)} of {len(timelines)} requests ended with '{failed[0].finish_reason}'{why}; "
            "rerun with LMD_DEBUG=1 or fewer prompts / a smaller --concurrency"
        )
    return ThroughputRun(timelines, total, concurrency, max_in_flight, counter_growth(before, engine.stats()))


async def _run_all(
    engine: Engine,
    requests: Sequence[BenchRequest],
    concurrency: int,
    temperature: float,
    seed: int,
    on_done: Callable[[Timeline], None] | None,
    clock: Clock,
) -> tuple[list[Timeline], int]:
    results: list[Timeline | None] = [None] * len(requests)
    indices = iter(range(len(requests)))  # shared by the workers: each index is taken exactly once
    in_flight = max_in_flight = 0

    async def worker() -> None:
        nonlocal in_flight, max_in_flight
        for i in indices:
            config = generation_config(requests[i], temperature, None if temperature == 0 else seed + i)
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                results[i] = await run_request(engine, requests[i], config, clock)
            finally:
                in_flight -= 1
            if on_done is not None:
                on_done(results[i])  # type: ignore[arg-type]

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return [r for r in results if r is not None], max_in_flight
