"""Metrics from known timelines (checked against numpy) and the JSON schema of both reports."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lmd.bench.latency import BatchLatency
from lmd.bench.report import (
    SUMMARY_KEYS,
    latency_report,
    print_latency,
    print_throughput,
    throughput_report,
    throughput_sweep_report,
)
from lmd.bench.throughput import STAT_COUNTERS, ThroughputRun
from lmd.bench.timeline import Timeline

COUNTERS = dict.fromkeys(STAT_COUNTERS, 0) | {"preemptions": 2, "prefix_hit_tokens": 64}


def _timeline(submitted: float, times: list[float], prompt_len: int = 10, reason: str = "length") -> Timeline:
    return Timeline(prompt_len, submitted, tuple(times), times[-1] if times else submitted + 0.5, reason, len(times), 0)


TIMELINES = [
    _timeline(0.0, [0.5, 0.6, 0.8, 1.1]),
    _timeline(0.2, [1.2]),
    _timeline(0.3, [0.9, 1.0, 1.3], 30),
    _timeline(1.0, [2.0, 2.5], 5, "stop"),
]


def test_timeline_metrics():
    t = TIMELINES[0]
    assert t.ttft == pytest.approx(0.5) and t.latency == pytest.approx(1.1) and t.output_len == 4
    assert t.tpot == pytest.approx((1.1 - 0.5) / 3) and t.inter_token == pytest.approx([0.1, 0.2, 0.3])
    assert TIMELINES[1].tpot is None and TIMELINES[1].inter_token == []
    empty = _timeline(0.0, [], reason="abort")
    assert empty.ttft is None and empty.tpot is None and empty.output_len == 0


def test_throughput_report_values_and_schema():
    run = ThroughputRun(TIMELINES, total_s=2.5, concurrency=2, max_in_flight=2, engine_counters=COUNTERS)
    report = throughput_report(run, {"model": "m", "dataset": "d"})
    assert json.loads(json.dumps(report)) == report
    assert set(report) == {
        "benchmark",
        "settings",
        "requests",
        "concurrency",
        "max_in_flight",
        "total_s",
        "requests_per_s",
        "input_tokens",
        "output_tokens",
        "input_tokens_per_s",
        "output_tokens_per_s",
        "total_tokens_per_s",
        "ttft_ms",
        "tpot_ms",
        "latency_ms",
        "finish_reasons",
        "engine",
    }
    assert report["benchmark"] == "throughput" and report["requests"] == 4
    assert (report["input_tokens"], report["output_tokens"]) == (55, 10)
    assert report["requests_per_s"] == pytest.approx(4 / 2.5)
    assert report["output_tokens_per_s"] == pytest.approx(4.0) and report["total_tokens_per_s"] == pytest.approx(26)
    ttft = [500.0, 1000.0, 600.0, 1000.0]
    tpot = [200.0, 200.0, 500.0]  # the one-token request has no TPOT
    for key, values in (("ttft_ms", ttft), ("tpot_ms", tpot)):
        summary = report[key]
        assert set(summary) == set(SUMMARY_KEYS) and summary["count"] == len(values)
        assert summary["mean"] == pytest.approx(np.mean(values))
        assert summary["median"] == pytest.approx(np.median(values))
        assert summary["p99"] == pytest.approx(np.percentile(values, 99))
    assert report["finish_reasons"] == {"length": 3, "stop": 1}
    assert report["engine"]["preemptions"] == 2 and report["engine"]["prefix_hit_tokens"] == 64


def test_latency_report_values_and_schema():
    batch = BatchLatency(2, [TIMELINES[:2], TIMELINES[2:]], [1.2, 1.5], COUNTERS)
    report = latency_report([batch], {"model": "m", "input_len": 10, "output_len": 4, "iters": 2})
    assert json.loads(json.dumps(report)) == report
    [b] = report["batches"]
    assert set(b) == {
        "batch_size",
        "iterations",
        "output_tokens",
        "iteration_s",
        "ttft_ms",
        "decode_ms_per_token",
        "inter_token_ms",
        "tokens_per_s",
        "decode_tokens_per_s",
        "engine",
    }
    assert (b["batch_size"], b["iterations"], b["output_tokens"]) == (2, 2, 10)
    assert b["tokens_per_s"] == pytest.approx(10 / 2.7)
    gaps = [100.0, 200.0, 300.0, 100.0, 300.0, 500.0]
    assert b["inter_token_ms"]["count"] == 6 and b["inter_token_ms"]["p99"] == pytest.approx(np.percentile(gaps, 99))
    assert b["decode_ms_per_token"]["mean"] == pytest.approx(np.mean([200.0, 200.0, 500.0]))
    assert b["decode_tokens_per_s"] == pytest.approx(2 / 0.3)


def test_tables_print_the_headline_numbers(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    run = ThroughputRun(TIMELINES, 2.5, 2, 2, COUNTERS)
    print_throughput(throughput_report(run, {"model": "m", "dataset": "d"}))
    out = capsys.readouterr().out
    for text in ("requests/s", "1.600", "TTFT ms mean / median / p99", "775.00 / 800.00", "preemptions", "64"):
        assert text in out
    print_latency(
        latency_report(
            [BatchLatency(2, [TIMELINES[:2]], [1.2], COUNTERS)],
            {"model": "m", "input_len": 10, "output_len": 4, "iters": 1},
        )
    )
    out = capsys.readouterr().out
    assert "10 in / 4 out" in out and "decode ms/tok" in out


def test_a_sweep_holds_each_runs_report_and_one_run_stays_as_it_was(capsys, monkeypatch):
    settings = {"model": "m", "dataset": "d"}
    one, two = (ThroughputRun(TIMELINES, 2.5, c, c, COUNTERS) for c in (1, 4))
    assert throughput_sweep_report([one], settings, "lmd") == throughput_report(one, settings)
    sweep = throughput_sweep_report([one, two], settings, "engine")
    assert json.loads(json.dumps(sweep)) == sweep
    assert sweep == {"benchmark": "throughput", "label": "engine", "settings": settings,
                     "runs": [throughput_report(one, settings), throughput_report(two, settings)]}  # fmt: skip
    monkeypatch.setenv("COLUMNS", "200")
    print_throughput(sweep)
    out = capsys.readouterr().out
    assert "concurrency 1" in out and "concurrency 4" in out and out.count("775.00 / 800.00") == 2
