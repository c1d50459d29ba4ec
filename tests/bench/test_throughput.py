"""Throughput runs on a tiny engine: token accounting against the engine's own counts, and the concurrency limit."""

from __future__ import annotations

import random

import pytest

from lmd.bench.sampling import BenchRequest
from lmd.bench.throughput import run_throughput
from lmd.bench.timeline import generation_config
from lmd.errors import LmdError


class CountingEngine:
    """The engine as the runner sees it, counting requests submitted and not yet finished (and the engine's own
    running + waiting at each submission)."""

    def __init__(self, engine) -> None:
        self.engine, self.open, self.peak, self.engine_peak = engine, 0, 0, 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, prompt, gen_config=None, request_id=None, apply_chat_template=True):
        stats = self.engine.stats()
        self.engine_peak = max(self.engine_peak, stats.running + stats.waiting)
        stream = self.engine.generate(prompt, gen_config, request_id, apply_chat_template)
        self.open += 1
        self.peak = max(self.peak, self.open)
        return _CountedStream(stream, self)


class _CountedStream:
    def __init__(self, stream, owner: CountingEngine) -> None:
        self.stream, self.owner = stream, owner

    async def __aiter__(self):
        async for delta in self.stream:
            if delta.finish_reason is not None:
                self.owner.open -= 1
            yield delta


def _requests(n: int, output_len, exact: bool, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = output_len(i) if callable(output_len) else output_len
        out.append(BenchRequest(tuple(rng.randrange(3, 49000) for _ in range(rng.randint(3, 40))), length, exact))
    return out


@pytest.mark.parametrize("concurrency", [1, 3, 20])
def test_exact_output_accounting_and_concurrency_limit(engine, concurrency):
    requests = _requests(12, 6, exact=True, seed=concurrency)
    counting = CountingEngine(engine)
    done = []
    run = run_throughput(counting, requests, concurrency, on_done=done.append)
    assert len(run.timelines) == len(done) == 12 and sorted(map(id, done)) == sorted(map(id, run.timelines))
    assert run.output_tokens == 12 * 6 == run.engine_counters["generated_tokens"]
    assert [t.output_len for t in run.timelines] == [t.completion_tokens for t in run.timelines] == [6] * 12
    assert run.input_tokens == sum(r.prompt_len for r in requests) == run.engine_counters["prompt_tokens"]
    assert [t.prompt_len for t in run.timelines] == [r.prompt_len for r in requests]  # results in request order
    assert run.finish_reasons == {"length": 12}
    limit = min(concurrency, 12)
    assert run.max_in_flight == counting.peak == limit
    # the engine may still list a request whose last token the runner has already read, never one more
    assert counting.open == 0 and counting.engine_peak <= limit
    for t in run.timelines:
        assert t.submitted <= t.token_times[0] and list(t.token_times) == sorted(t.token_times)
        assert t.token_times[-1] <= t.finished and t.ttft <= t.latency
    if concurrency == 1:  # strictly one after the other
        for a, b in zip(run.timelines, run.timelines[1:], strict=False):
            assert b.submitted >= a.finished


def test_counted_tokens_equal_the_generated_ids_when_eos_may_stop(engine):
    requests = _requests(6, lambda i: 2 + 2 * i, exact=False, seed=11)
    run = run_throughput(engine, requests, 3)
    expected = []
    for r in requests:  # the same greedy requests, one at a time, read whole
        expected.append(engine.generate(list(r.prompt_ids), generation_config(r)).result().token_ids)
    assert [t.output_len for t in run.timelines] == [len(ids) for ids in expected]
    assert run.output_tokens == sum(len(ids) for ids in expected) == run.engine_counters["generated_tokens"]
    assert all(t.output_len <= r.output_len for t, r in zip(run.timelines, requests, strict=True))


def test_prefix_hits_are_counted(engine):
    shared = tuple(range(100, 140))  # 40 tokens = 5 full blocks of 8, shared by every prompt
    requests = [BenchRequest(shared + (200 + i, 300 + i), 2, True) for i in range(4)]
    run = run_throughput(engine, requests, 1)  # one at a time: each later prompt finds the first one's blocks
    assert run.engine_counters["prefix_hit_tokens"] == 3 * 40
    assert [t.cached_tokens for t in run.timelines] == [0, 40, 40, 40]


def test_bad_arguments(engine):
    with pytest.raises(LmdError, match="--concurrency must be at least 1"):
        run_throughput(engine, _requests(1, 2, True), 0)
    with pytest.raises(LmdError, match="no requests"):
        run_throughput(engine, [], 4)
