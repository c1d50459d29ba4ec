"""`lmd bench serve` against a real `lmd serve` app (tiny random Llama) over HTTP: counted tokens, consistent stats,
the same prompts as the offline benchmark, failed requests counted, bad input as one line."""

from __future__ import annotations

import json

import pytest

from lmd.bench.serve_run import CHAT, COMPLETIONS, LoadConfig, ServeTarget, request_body, run_serve
from lmd.bench.workload import PromptSource, build_requests, prompt_text, tokenizer_codec
from lmd.turbomind.tp_group import free_port
from tests.eval.test_cli import run_main


def serve_bench(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    return run_main(monkeypatch, capsys, "bench", "serve", *args)


def test_json_sweep_counts_every_token(server_url, bench_ws, tmp_path, monkeypatch, capsys):
    saved = tmp_path / "lmd.json"
    code, out, err = serve_bench(
        monkeypatch, capsys, server_url + "/v1", "--tokenizer", str(bench_ws), "--dataset", "random",
        "--random-input-len", "8", "--num-prompts", "6", "--fixed-output-len", "4", "--max-concurrency", "1,3",
        "--json", "--save-result", str(saved),
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report == json.loads(saved.read_text())
    assert report["benchmark"] == "serve" and report["label"] == "lmd"  # /v1/models' owned_by
    settings = report["settings"]
    assert settings["model"] == "tiny" and settings["url"] == server_url and settings["max_concurrency"] == [1, 3]
    assert [r["concurrency"] for r in report["runs"]] == [1, 3]
    for run in report["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0 and run["errors"] == {}
        assert run["output_tokens"] == 6 * 4 and run["input_tokens"] == 6 * 8 and run["usage_reported"] == 6
        assert run["max_in_flight"] == run["concurrency"]
        ttft, tpot, e2e = run["ttft_ms"], run["tpot_ms"], run["latency_ms"]
        assert ttft["count"] == tpot["count"] == e2e["count"] == 6
        assert ttft["min"] > 0 and ttft["max"] <= e2e["max"] and ttft["median"] <= e2e["median"]
        assert tpot["max"] * 3 <= e2e["max"]  # three tokens after the first fit in the slowest request
        assert run["output_tokens_per_s"] == pytest.approx(24 / run["total_s"])


def test_every_request_is_timed_consistently(server_url, bench_ws):
    codec = tokenizer_codec(str(bench_ws))
    requests = build_requests(codec, PromptSource("random", (), (), 6), _sampling(5, 3), True, None)
    target = ServeTarget(server_url, COMPLETIONS, "tiny")
    bodies = [request_body(target, r, lambda: "", 0.0, 0) for r in requests]
    bodies[1] = {**bodies[1], "prompt": [10**7]}  # not a token id: the server answers 400
    (run,) = run_serve(target, requests, bodies, LoadConfig((2,), request_rate=200.0))
    assert len(run.records) == 5 and len(run.completed) == 4
    ((error, count),) = run.errors.items()
    assert count == 1 and error.startswith("HTTP 400") and "prompt" in error
    for r in run.completed:
        assert r.output_tokens == 3 and r.usage_reported and r.finish_reason == "length"
        assert 1 <= len(r.chunk_times) <= 3 and r.ttft is not None and 0 < r.ttft <= r.latency
        assert r.tpot == pytest.approx((r.latency - r.ttft) / 2)
        assert all(gap >= 0 for gap in r.inter_chunk)


def test_chat_sends_the_offline_benchmarks_prompts(server_url, bench_ws, tmp_path, monkeypatch, capsys):
    rows = [{"conversations": [{"from": "human", "value": f"Tell me about topic {i}. " * (1 + i)}]} for i in range(4)]
    dataset = tmp_path / "prompts.json"
    dataset.write_text(json.dumps(rows))
    flags = ("--dataset", str(dataset), "--num-prompts", "3", "--fixed-output-len", "2", "--tokenizer", str(bench_ws))
    code, out, err = serve_bench(monkeypatch, capsys, server_url, "--endpoint", CHAT, *flags, "--json")
    assert code == 0, err
    (run,) = json.loads(out)["runs"]
    codec = tokenizer_codec(str(bench_ws))
    from lmd.bench.workload import read_prompt_source

    requests = build_requests(codec, read_prompt_source(str(dataset), None, 8), _sampling(3, 2), True, None)
    assert run["input_tokens"] == sum(r.prompt_len for r in requests)  # the server's count of the same prompts
    assert [prompt_text(codec, r) for r in requests] == [r.text for r in requests]
    # ... and that text is the dataset's prompt whose chat-templated ids the offline benchmark runs
    prompts = [row["conversations"][0]["value"] for row in rows]
    assert all(r.text in prompts and codec.encode(r.text, True) == list(r.prompt_ids) for r in requests)
    code, out, err = serve_bench(monkeypatch, capsys, server_url, *flags, "--max-concurrency", "2")
    assert code == 0, err
    assert "TTFT ms mean / p50 / p99" in out and "E2E latency" in out and "3 / 0" in out


def _sampling(num_prompts: int, output_len: int):
    from lmd.bench.sampling import SamplingConfig

    return SamplingConfig(num_prompts, fixed_output_len=output_len)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-concurrency", "1,x"], "--max-concurrency '1,x' is not a whole number"),
        (["--max-concurrency", "0"], "--max-concurrency values must be at least 1"),
        (["--request-rate", "0"], "--request-rate must be above 0"),
        (["--endpoint", "/v1/embeddings"], "--endpoint /v1/embeddings is unknown"),
        (["--endpoint", CHAT, "--raw-prompts"], "--raw-prompts applies to /v1/completions"),
        (["--baseline", "x.json"], "add --plot FILE.png"),
        (["--plot", "out.gif"], "--plot out.gif: give a file name ending in .png, .svg, .pdf"),
        (["--model", "other"], "--model other is not served by"),
        (["--tokenizer", "no-such-dir"], "--tokenizer no-such-dir is neither a path nor a hub id"),
        ([], "the served model name 'tiny' is not a tokenizer lmd can load; pass --tokenizer"),
    ],
)
def test_bad_input_is_one_line(server_url, monkeypatch, capsys, flags, message):
    code, out, err = serve_bench(monkeypatch, capsys, server_url, "--dataset", "random", *flags)
    assert code == 1 and out == ""
    assert err.startswith("lmd: ") and message in err and err.count("\n") == 1, err


def test_an_unreachable_url_names_it_and_the_fix(monkeypatch, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = serve_bench(monkeypatch, capsys, url, "--dataset", "random")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith(f"lmd: cannot reach {url}") and "lmd serve" in err
    code, _, err = serve_bench(monkeypatch, capsys, "localhost:23333")
    assert code == 1 and "must start with http://" in err


def test_an_existing_output_needs_force(server_url, bench_ws, tmp_path, monkeypatch, capsys):
    saved = tmp_path / "taken.json"
    saved.write_text("{}")
    flags = ("--tokenizer", str(bench_ws), "--dataset", "random", "--random-input-len", "4", "--num-prompts", "2",
             "--fixed-output-len", "2", "--save-result", str(saved))  # fmt: skip
    code, out, err = serve_bench(monkeypatch, capsys, server_url, *flags)
    assert code == 1 and out == "" and "already exists; pass --force" in err and err.count("\n") == 1
    assert saved.read_text() == "{}"
    code, _, err = serve_bench(monkeypatch, capsys, server_url, *flags, "--force")
    assert code == 0, err
    assert json.loads(saved.read_text())["runs"][0]["completed"] == 2
