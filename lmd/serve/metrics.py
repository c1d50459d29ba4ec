"""GET /metrics: the engine's counters and the server's request counts in Prometheus' text format (version 0.0.4).

Hand-written rather than through prometheus_client: every value is read from `engine.stats()` or a dict at scrape
time, so the whole registry machinery would only re-state what these few lines print.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from lmd.turbomind.engine import EngineStats
from lmd.turbomind.request_stream import Usage
from lmd.turbomind.request_times import RequestTimes

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ENDPOINTS = frozenset({CHAT, COMPLETIONS, "/v1/models", "/health", "/metrics"})

# (metric name, type, EngineStats field, help)
_ENGINE_METRICS = (
    ("lmd_requests_running", "gauge", "running", "Requests in the running batch."),
    ("lmd_requests_waiting", "gauge", "waiting", "Requests queued for a slot or KV blocks."),
    ("lmd_kv_blocks_total", "gauge", "blocks_total", "KV cache blocks in the pool."),
    ("lmd_kv_blocks_used", "gauge", "blocks_used", "KV cache blocks held by requests."),
    ("lmd_kv_blocks_free", "gauge", "blocks_free", "KV cache blocks free (cached prefix blocks included)."),
    ("lmd_kv_blocks_cached", "gauge", "blocks_cached", "Free KV cache blocks still holding a reusable prefix."),
    ("lmd_prompt_tokens_total", "counter", "prompt_tokens", "Prompt tokens submitted."),
    ("lmd_computed_tokens_total", "counter", "computed_tokens", "Tokens the model ran (prefill chunks + decodes)."),
    (
        "lmd_prefix_cache_hit_tokens_total",
        "counter",
        "prefix_hit_tokens",
        "Prompt tokens whose KV came from the prefix cache.",
    ),
    ("lmd_generation_tokens_total", "counter", "generated_tokens", "Tokens generated."),
    ("lmd_preemptions_total", "counter", "preemptions", "Requests preempted to free KV blocks."),
    ("lmd_engine_steps_total", "counter", "steps", "Engine batch steps."),
    (
        "lmd_engine_prefill_steps_total",
        "counter",
        "prefill_steps",
        "Engine steps that computed a prompt chunk of more than one token (run eagerly on CUDA; the others replay "
        "CUDA graphs).",
    ),
)


@dataclass
class RequestCounts:
    """What the HTTP layer saw: finished generations by finish reason, rejected requests by status."""

    finished: Counter[tuple[str, str]] = field(default_factory=Counter)  # (endpoint, finish_reason)
    rejected: Counter[tuple[str, int]] = field(default_factory=Counter)  # (endpoint, status)

    def finish(self, endpoint: str, reason: str | None) -> None:
        self.finished[(endpoint, reason or "abort")] += 1

    def reject(self, path: str, status: int) -> None:
        endpoint = path if path in ENDPOINTS else "other"  # arbitrary paths (404s) must not grow the label set
        self.rejected[(endpoint, status)] += 1


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count (rendered as _bucket, _sum, _count)."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name, self.help_text, self.buckets = name, help_text, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bucket (+Inf only)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, lines: list[str]) -> None:
        _header(lines, self.name, "histogram", self.help_text)
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{bound:g}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {self.sum:.6g}")
        lines.append(f"{self.name}_count {self.count}")


_SECONDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0)  # vLLM's request-latency buckets
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
         160.0, 640.0, 2560.0)
_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass
class LatencyHistograms:
    """Per generation (a prompt's sample), from the engine's RequestTimes and the request's arrival at the server."""

    queue: Histogram = field(default_factory=lambda: Histogram(
        "lmd_request_queue_time_seconds", "Time from queued in the engine to its first step.", _SECONDS))
    ttft: Histogram = field(default_factory=lambda: Histogram(
        "lmd_time_to_first_token_seconds", "Time from the request's arrival to its first token.", _TTFT))
    tpot: Histogram = field(default_factory=lambda: Histogram(
        "lmd_time_per_output_token_seconds", "Mean time between output tokens after the first.", _TPOT))
    e2e: Histogram = field(default_factory=lambda: Histogram(
        "lmd_e2e_request_latency_seconds", "Time from the request's arrival to its last token.", _SECONDS))

    def observe(self, arrival: float, times: RequestTimes | None, usage: Usage | None) -> None:
        if times is None:
            return
        if times.scheduled is not None:
            self.queue.observe(times.scheduled - times.queued)
        if times.first_token is not None:
            self.ttft.observe(times.first_token - arrival)
            if usage is not None and usage.completion_tokens > 1:
                self.tpot.observe((times.finished - times.first_token) / (usage.completion_tokens - 1))
        self.e2e.observe(times.finished - arrival)

    def render(self, lines: list[str]) -> None:
        for histogram in (self.queue, self.ttft, self.tpot, self.e2e):
            histogram.render(lines)


def render_metrics(stats: EngineStats, counts: RequestCounts, latency: LatencyHistograms | None = None) -> str:
    lines: list[str] = []
    for name, kind, attr, help_text in _ENGINE_METRICS:
        _header(lines, name, kind, help_text)
        lines.append(f"{name} {getattr(stats, attr)}")
    usage = stats.blocks_used / stats.blocks_total if stats.blocks_total else 0.0
    _header(lines, "lmd_kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks held by requests.")
    lines.append(f"lmd_kv_cache_usage_ratio {usage:.6g}")
    if stats.speculative_method is not None:
        _speculative_metrics(lines, stats)
    _header(lines, "lmd_requests_finished_total", "counter", "Requests finished, by endpoint and finish reason.")
    for (endpoint, reason), value in sorted(counts.finished.items()):
        lines.append(f'lmd_requests_finished_total{{endpoint="{endpoint}",finish_reason="{reason}"}} {value}')
    _header(lines, "lmd_requests_rejected_total", "counter", "Requests answered with an error, by endpoint and status.")
    for (endpoint, status), value in sorted(counts.rejected.items()):
        lines.append(f'lmd_requests_rejected_total{{endpoint="{endpoint}",status="{status}"}} {value}')
    if latency is not None:
        latency.render(lines)
    return "\n".join(lines) + "\n"


# (metric name, type, EngineStats field, help) of speculative decoding, labelled by method
_SPECULATIVE_METRICS = (
    ("lmd_spec_proposed_tokens_total", "counter", "spec_proposed_tokens", "Tokens proposed for verification."),
    ("lmd_spec_accepted_tokens_total", "counter", "spec_accepted_tokens", "Proposed tokens the model accepted."),
    ("lmd_spec_verifications_total", "counter", "spec_verifications", "Verifications of proposed tokens."),
    ("lmd_spec_mean_accepted_length", "gauge", "spec_mean_accepted_length",
     "Tokens made per verification: accepted proposals plus the model's own token."),
)


def _speculative_metrics(lines: list[str], stats: EngineStats) -> None:
    for name, kind, attr, help_text in _SPECULATIVE_METRICS:
        _header(lines, name, kind, help_text)
        value = getattr(stats, attr)
        text = f"{value:.6g}" if isinstance(value, float) else str(value)
        lines.append(f'{name}{{method="{stats.speculative_method}"}} {text}')


def _header(lines: list[str], name: str, kind: str, help_text: str) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
