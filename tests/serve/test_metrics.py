"""GET /metrics: Prometheus text whose counters follow the requests the server answered."""

from __future__ import annotations

import re

from tests.serve.conftest import MODEL

CHAT_LENGTH = 'lmd_requests_finished_total{endpoint="/v1/chat/completions",finish_reason="length"}'
CHAT_400 = 'lmd_requests_rejected_total{endpoint="/v1/chat/completions",status="400"}'
SAMPLE = re.compile(r"^([a-z_][a-z0-9_]*(?:\{[^}]*\})?) (\S+)$")


def _scrape(client) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples, typed = {}, set()
    for line in response.text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        assert match, f"not a Prometheus sample: {line!r}"
        name = match.group(1)
        base = name.split("{")[0]
        family = base if base in typed else re.sub(r"_(bucket|sum|count)$", "", base)  # a histogram's series
        assert family in typed, f"{name} has no # TYPE line"
        samples[name] = float(match.group(2))
    return samples


def test_counters_follow_requests(client, engine):
    before = _scrape(client)
    for name in (
        "lmd_requests_running",
        "lmd_requests_waiting",
        "lmd_kv_blocks_used",
        "lmd_kv_blocks_free",
        "lmd_prompt_tokens_total",
        "lmd_generation_tokens_total",
        "lmd_preemptions_total",
        "lmd_prefix_cache_hit_tokens_total",
        "lmd_kv_cache_usage_ratio",
    ):
        assert name in before
    assert before["lmd_kv_blocks_total"] == engine.stats().blocks_total
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": 7,
        "temperature": 0,
        "ignore_eos": True,
    }
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert client.post("/v1/chat/completions", json={**body, "temperature": 9}).status_code == 400
    after = _scrape(client)
    assert after["lmd_prompt_tokens_total"] - before["lmd_prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["lmd_generation_tokens_total"] - before["lmd_generation_tokens_total"] == 7
    assert after[CHAT_LENGTH] - before.get(CHAT_LENGTH, 0) == 1
    assert after[CHAT_400] - before.get(CHAT_400, 0) == 1
    assert after["lmd_engine_steps_total"] > before["lmd_engine_steps_total"]
    # the prompt's prefill is one step with a chunk of many tokens; the 6 decodes after it are not
    prefill_steps = after["lmd_engine_prefill_steps_total"] - before["lmd_engine_prefill_steps_total"]
    assert 1 <= prefill_steps < after["lmd_engine_steps_total"] - before["lmd_engine_steps_total"]
    assert after["lmd_kv_blocks_used"] == 0 and after["lmd_kv_blocks_free"] == after["lmd_kv_blocks_total"]
    assert after["lmd_requests_running"] == after["lmd_requests_waiting"] == 0


def test_unknown_paths_do_not_grow_the_label_set(client):
    for path in ("/a", "/b", "/c"):
        assert client.get(path).status_code == 404
    samples = _scrape(client)
    assert samples['lmd_requests_rejected_total{endpoint="other",status="404"}'] >= 3
    assert not any('endpoint="/a"' in name for name in samples)


def test_health(client):
    assert client.get("/health").json() == {"status": "ok"}
