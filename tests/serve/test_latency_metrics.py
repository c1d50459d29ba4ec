"""/metrics latency histograms (queue time, TTFT, TPOT, end-to-end) from the engine's RequestTimes, one observation
per generation; Histogram's bucket arithmetic."""

from __future__ import annotations

import re

from lmd.serve.metrics import Histogram
from tests.serve.conftest import MODEL


def _series(text: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)}


def test_histograms_count_every_generation(client):
    before = client.get("/metrics").text
    count = lambda text, name: float(re.search(rf"^{name}_count (\S+)$", text, re.M).group(1))  # noqa: E731
    body = {"model": MODEL, "prompt": ["Once", "upon a"], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=chat) as response:
        response.read()
    after = client.get("/metrics").text
    for name in ("lmd_time_to_first_token_seconds", "lmd_e2e_request_latency_seconds",
                 "lmd_request_queue_time_seconds", "lmd_time_per_output_token_seconds"):
        assert count(after, name) - count(before, name) == 3, name  # two prompts + one chat
        buckets = _series(after, name)
        values = list(buckets.values())
        assert values == sorted(values) and buckets["+Inf"] == count(after, name)
    assert float(re.search(r"^lmd_e2e_request_latency_seconds_sum (\S+)$", after, re.M).group(1)) > 0


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram("x", "test", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        h.observe(value)
    lines: list[str] = []
    h.render(lines)
    assert 'x_bucket{le="0.1"} 2' in lines and 'x_bucket{le="1"} 3' in lines and 'x_bucket{le="+Inf"} 4' in lines
    assert "x_count 4" in lines and "x_sum 3.65" in lines
