"""Latency runs on a tiny engine: exact token counts, one batch per step, and errors for sizes the engine can't hold."""

from __future__ import annotations

import pytest

from lmd.bench.latency import LatencyConfig, run_latency
from lmd.errors import LmdError


def test_exact_tokens_and_batches_admitted_together(engine):
    config = LatencyConfig(input_len=12, output_len=5, batch_sizes=(1, 4), warmup=1, iters=2, seed=3)
    ticks = []
    results = run_latency(engine, config, on_iteration=lambda: ticks.append(1))
    assert len(ticks) == 2 * 3 and [r.batch_size for r in results] == [1, 4]
    for r in results:
        b = r.batch_size
        assert len(r.iterations) == 2 and [len(batch) for batch in r.iterations] == [b, b]
        assert all(t.output_len == t.completion_tokens == 5 and t.prompt_len == 12 for t in r.timelines)
        assert r.output_tokens == b * 5 * 2 == r.engine_counters["generated_tokens"]
        # the whole batch prefills in one step (4 x 12 tokens fit the 64-token budget), then 4 decode steps
        assert r.engine_counters["steps"] == 2 * 5
        assert r.engine_counters["prefix_hit_tokens"] == 0 and r.engine_counters["preemptions"] == 0
        assert r.ttft().count == 2 * b and r.decode_per_token().count == 2 * b and r.inter_token().count == 2 * b * 4
        assert r.decode_tokens_per_s == pytest.approx(b / r.decode_per_token().mean)
        assert r.tokens_per_s == pytest.approx(b * 5 * 2 / sum(r.iteration_s))
        for batch in r.iterations:  # one submission time per batch
            assert len({t.submitted for t in batch}) == 1


def test_sizes_the_engine_cannot_hold(engine):
    with pytest.raises(LmdError, match="exceeds the engine's max_batch_size 8; raise --max-batch-size"):
        run_latency(engine, LatencyConfig(4, 4, (2, 9), 0, 1))
    with pytest.raises(LmdError, match="--input-len 200 \\+ --output-len 100 exceeds the engine's 256 tokens"):
        run_latency(engine, LatencyConfig(200, 100, (1,), 0, 1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_len": 0}, "--input-len must be at least 1"),
        ({"output_len": 0}, "--output-len must be at least 1"),
        ({"warmup": -1}, "--warmup must be at least 0"),
        ({"iters": 0}, "--iters must be at least 1"),
        ({"batch_sizes": (4, 0)}, "--batch-size values must be at least 1"),
        ({"batch_sizes": ()}, "--batch-size"),
    ],
)
def test_bad_config(kwargs, message):
    with pytest.raises(LmdError, match=message):
        LatencyConfig(**kwargs)
