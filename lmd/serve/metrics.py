"""GET /metrics: the engine's counters and the server's request counts in Prometheus' text format (version 0.0.4).

Hand-written rather than through prometheus_client: every value is read from `engine.stats()` or a dict at scrape
time, so the whole registry machinery would only re-state what these few lines print.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from lmd.turbomind.engine import EngineStats

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


def render_metrics(stats: EngineStats, counts: RequestCounts) -> str:
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
