"""`lmd bench throughput|latency` end to end on a tiny workspace (JSON and table), and bad input as one line, exit 1."""

from __future__ import annotations

import json

import pytest

from tests.eval.test_cli import run_main

ENGINE_FLAGS = (
    "--device cpu --cache-block-seq-len 8 --cache-max-entry-count 256 --max-context-token-num 64 --session-len 256"
)


# `lmd bench throughput --json` with one --concurrency value, as before concurrency lists (benchmarks/engine.py reads
# requests_per_s, *_tokens_per_s, ttft_ms, tpot_ms, engine; benchmarks/serving_workloads.py requests, total_s, ...)
SINGLE_RUN_KEYS = {
    "benchmark", "settings", "requests", "concurrency", "max_in_flight", "total_s", "requests_per_s", "input_tokens",
    "output_tokens", "input_tokens_per_s", "output_tokens_per_s", "total_tokens_per_s", "ttft_ms", "tpot_ms",
    "latency_ms", "finish_reasons", "engine",
}  # fmt: skip


def bench(monkeypatch, capsys, command: str) -> tuple[int, str, str]:
    """`lmd bench` + the words of `command` (paths here hold no spaces)."""
    return run_main(monkeypatch, capsys, "bench", *command.split())


def bench_ok(monkeypatch, capsys, command: str) -> str:
    """What a successful `lmd bench` + `command` printed on stdout."""
    code, out, err = bench(monkeypatch, capsys, command)
    assert code == 0, err
    return out


@pytest.fixture
def sharegpt_file(tmp_path):
    rows = [
        {"id": str(i), "conversations": [{"from": "human", "value": f"Tell me about topic {i}. " * (1 + i % 4)}]}
        for i in range(12)
    ]
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(rows))
    return path


def test_throughput_json_from_a_sharegpt_file(bench_ws, sharegpt_file, monkeypatch, capsys):
    code, out, err = bench(
        monkeypatch,
        capsys,
        f"throughput {bench_ws} --dataset {sharegpt_file} --num-prompts 6 --concurrency 2 --fixed-output-len 4 "
        f"--seed 1 --max-batch-size 4 {ENGINE_FLAGS} --json",
    )
    assert code == 0, err
    report = json.loads(out)
    assert set(report) == SINGLE_RUN_KEYS  # one --concurrency value: the object benchmarks/*.py and --baseline read
    assert report["benchmark"] == "throughput" and report["requests"] == 6 and report["max_in_flight"] == 2
    assert report["output_tokens"] == 6 * 4 == report["engine"]["generated_tokens"]
    assert report["input_tokens"] == report["engine"]["prompt_tokens"]
    assert report["finish_reasons"] == {"length": 6}
    settings = report["settings"]
    assert settings["files"] == [str(sharegpt_file)] and settings["chat_template"] is True
    assert settings["engine_config"]["max_batch_size"] == 4 and settings["device"] == "cpu"
    assert report["ttft_ms"]["count"] == 6 and report["tpot_ms"]["count"] == 6
    # every prompt shares the ChatML system preamble, so later prompts reuse its cached blocks
    assert report["engine"]["prefix_hit_tokens"] > 0


def test_throughput_table_on_random_prompts(bench_ws, monkeypatch, capsys):
    code, out, err = bench(
        monkeypatch,
        capsys,
        f"throughput {bench_ws} --dataset random --random-input-len 10 --num-prompts 4 --max-output-len 3 {ENGINE_FLAGS}",
    )
    assert code == 0, err
    assert "requests / concurrency" in out and "4 / 64" in out and "40 tokens" in out and "12 tokens" in out


def test_a_concurrency_list_runs_the_workload_once_per_value(bench_ws, monkeypatch, capsys):
    sweep = "--dataset random --random-input-len 6 --num-prompts 4 --fixed-output-len 3 --concurrency 1,2"
    out = bench_ok(monkeypatch, capsys, f"throughput {bench_ws} {sweep} --concurrency 2 {ENGINE_FLAGS} --json")
    report = json.loads(out)
    assert set(report) == {"benchmark", "label", "settings", "runs"} and report["label"] == "lmd"
    first, second = report["runs"]
    for run, level in ((first, 1), (second, 2)):
        assert set(run) == SINGLE_RUN_KEYS and run["settings"] == report["settings"]
        assert (run["concurrency"], run["max_in_flight"], run["requests"]) == (level, level, 4)
        assert run["input_tokens"] == 4 * 6 == run["engine"]["prompt_tokens"]
        assert run["output_tokens"] == 4 * 3 == run["engine"]["generated_tokens"]
        assert run["ttft_ms"]["count"] == 4 == run["latency_ms"]["count"] and run["finish_reasons"] == {"length": 4}
        assert run["output_tokens_per_s"] == pytest.approx(12 / run["total_s"])
        assert run["ttft_ms"]["max"] <= run["latency_ms"]["max"]
    out = bench_ok(monkeypatch, capsys, f"throughput {bench_ws} {sweep} --num-prompts 2 {ENGINE_FLAGS}")
    assert "concurrency 1" in out and "concurrency 2" in out and out.count("6 tokens") == 2  # 2 x 3 per run


def test_latency_json_and_table(bench_ws, monkeypatch, capsys):
    code, out, err = bench(
        monkeypatch,
        capsys,
        f"latency {bench_ws} --input-len 8 --output-len 3 --batch-size 1,2 --batch-size 2 --warmup 0 --iters 1 "
        f"{ENGINE_FLAGS} --json",
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["benchmark"] == "latency" and report["settings"]["batch_sizes"] == [1, 2]
    assert report["settings"]["engine_config"]["max_batch_size"] == 2  # defaults to the largest batch
    assert report["settings"]["engine_config"]["cuda_graph"] is True and report["settings"]["decode_graphs"] is False
    assert [(b["batch_size"], b["output_tokens"]) for b in report["batches"]] == [(1, 3), (2, 6)]
    code, out, err = bench(
        monkeypatch,
        capsys,
        f"latency {bench_ws} --input-len 8 --output-len 2 --warmup 0 --iters 1 {ENGINE_FLAGS}",
    )
    assert code == 0, err
    assert "8 in / 2 out" in out and "TTFT ms" in out


def test_enforce_eager_reaches_the_engine(bench_ws, monkeypatch, capsys):
    code, out, err = bench(
        monkeypatch,
        capsys,
        f"latency {bench_ws} --input-len 8 --output-len 2 --batch-size 1 --warmup 0 --iters 1 {ENGINE_FLAGS} "
        "--enforce-eager --json",
    )
    assert code == 0, err
    settings = json.loads(out)["settings"]
    assert settings["engine_config"]["cuda_graph"] is False and settings["decode_graphs"] is False


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("throughput {ws} --dataset /nonexistent/sg.json", "--dataset /nonexistent/sg.json: no such file"),
        ("throughput /nonexistent/ws --dataset random", "/nonexistent/ws does not exist"),
        ("throughput {ws} --concurrency 0", "--concurrency values must be at least 1"),
        ("throughput {ws} --concurrency 1,x", "--concurrency '1,x' is not a whole number"),
        ("throughput {ws} --concurrency 8,", "--concurrency '8,' is not a whole number"),
        ("throughput {ws} --baseline b.json", "--baseline is drawn in the --plot figure"),
        ("throughput {ws} --plot out.txt", "--plot out.txt: give a file name ending in .png"),
        ("throughput {ws} --num-prompts 0", "--num-prompts must be at least 1"),
        ("throughput {ws} --min-input-len 9 --max-input-len 3", "--max-input-len 3 is below"),
        ("throughput {ws} --temperature 5", "--temperature 5.0 is outside"),
        ("throughput {ws} --dtype fp8", "--dtype 'fp8' is unknown"),
        ("throughput {ws} --quant-policy 8", "--quant-policy 8 is unknown"),
        ("latency {ws} --batch-size 1,x", "--batch-size '1,x' is not a whole number"),
        ("latency {ws} --input-len 0", "--input-len must be at least 1"),
        ("latency {ws} --iters 0", "--iters must be at least 1"),
        (f"latency {{ws}} --batch-size 4 --max-batch-size 2 {ENGINE_FLAGS}", "exceeds the engine's max_batch_size 2"),
    ],
)
def test_bad_input_is_one_line(bench_ws, monkeypatch, capsys, command, message):
    code, out, err = bench(monkeypatch, capsys, command.format(ws=bench_ws))
    assert code == 1 and out == ""
    assert err.startswith("lmd: ") and message in err and err.count("\n") == 1, err


def test_sharegpt_without_a_data_dir(bench_ws, monkeypatch, capsys):
    monkeypatch.delenv("LMD_DATA_DIR", raising=False)
    code, _, err = bench(monkeypatch, capsys, f"throughput {bench_ws}")
    assert code == 1 and "set LMD_DATA_DIR" in err and err.count("\n") == 1


@pytest.mark.parametrize("flag", ["--save-result", "--plot"])
def test_an_existing_output_is_refused_before_the_run(bench_ws, tmp_path, monkeypatch, capsys, flag):
    taken = tmp_path / ("r.json" if flag == "--save-result" else "p.png")
    taken.write_text("kept")
    command = f"throughput {bench_ws} --dataset /nonexistent/sg.json --concurrency 1,2 {flag} {taken}"
    code, out, err = bench(monkeypatch, capsys, command)  # the missing dataset would fail later
    assert code == 1 and out == "" and "already exists; pass --force" in err and err.count("\n") == 1, err
    assert taken.read_text() == "kept"
