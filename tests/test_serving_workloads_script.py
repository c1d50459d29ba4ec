"""benchmarks/serving_workloads.py on CPU: the lengths it counts, then --tiny end to end (lmd, HF static batching,
KV int8 at a capped pool, prefix reuse), checked through the JSON it writes."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import random
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving_workloads.py"
NUM_REQUESTS, HF_REQUESTS, KV_REQUESTS, CONVERSATIONS = 12, 6, 8, 5


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("serving_workloads_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"t{rng.randrange(3, 1000)}" for _ in range(n))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path, dict]:
    """A data dir in ../shared/data's layout and a word-level tokenizer: a text's token count is its word count."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    prompt_words = [2] + [rng.randrange(4, 60) for _ in range(15)]  # the 2-word prompt is below the 4-token floor
    output_words = [rng.randrange(1, 40) for _ in range(10)]
    turns = [(rng.randrange(5, 30), rng.randrange(3, 20)) for _ in range(CONVERSATIONS)]
    (root / "sharegpt").mkdir()
    rows = [{"conversations": [{"from": "human", "value": words(rng, n)}]} for n in prompt_words]
    (root / "sharegpt" / "prompts.json").write_text(json.dumps(rows))
    (root / "chat_prompts").mkdir()
    (root / "chat_prompts" / "alpaca_eval.jsonl").write_text(
        "".join(json.dumps({"instruction": "q", "output": words(rng, n)}) + "\n" for n in output_words))
    (root / "chat_prompts" / "mt_bench_question.jsonl").write_text(
        "".join(json.dumps({"question_id": i, "turns": [words(rng, a), words(rng, b)]}) + "\n"
                for i, (a, b) in enumerate(turns)))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, 1000)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(str(root / "tokenizer"))
    return root, root / "tokenizer", {"prompts": prompt_words, "outputs": output_words, "turns": turns}


@pytest.fixture(scope="module")
def lengths_file(script, data, tmp_path_factory) -> Path:
    root, tokenizer, _ = data
    path = tmp_path_factory.mktemp("lengths") / "lengths.json"
    script.main(["--prepare", str(path), "--data-dir", str(root), "--tokenizer", str(tokenizer),
                 "--num-requests", str(NUM_REQUESTS)])
    return path


def test_prepare_pairs_prompts_with_alpaca_lengths(script, data, lengths_file):
    _, _, truth = data
    lengths = script.load_lengths(lengths_file)
    assert len(lengths.requests) == NUM_REQUESTS
    prompts = [p for p, _ in lengths.requests]
    assert 2 not in prompts and set(prompts) <= set(truth["prompts"])
    outputs = [o for _, o in lengths.requests]
    # every one of the 10 reference lengths once, then the cycle starts again
    assert sorted(outputs[:10]) == sorted(truth["outputs"]) and outputs[10:] == outputs[:2]
    assert lengths.conversations == tuple(truth["turns"])  # no chat template: the plain counts
    assert lengths.source["chat_template"] is False


@pytest.fixture(scope="module")
def report(script, lengths_file, tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("out")
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        script.main(["--tiny", "--lengths", str(lengths_file), "--out", str(out), "--num-requests",
                     str(NUM_REQUESTS), "--hf-requests", str(HF_REQUESTS), "--kv-requests", str(KV_REQUESTS),
                     "--prefix-conversations", str(CONVERSATIONS), "--real-kv-int8"])
    return json.loads((out / "serving_workloads.json").read_text()), text.getvalue()


def test_tiny_run_has_every_phase(report):
    results, printed = report
    assert [p for p in results["phases"] if p.get("ok") is False or p.get("skipped")] == []
    assert all(p["wall_s"] >= 0 for p in results["phases"])
    assert set(results["models"]) == {"tiny"} and results["gpu"] == "cpu"
    assert "serving workloads" in printed and printed.rstrip().endswith("┘")  # the table comes last


def test_real_workload_token_counts(script, report, lengths_file):
    tiny = report[0]["models"]["tiny"]
    settings = script.Settings(**report[0]["settings"])
    expected = [script.clipped(p, o, settings) for p, o in script.load_lengths(lengths_file).requests]
    lmd = tiny["real"]["lmd"]
    assert lmd["requests"] == NUM_REQUESTS == lmd["max_in_flight"]  # all submitted at once
    assert lmd["output_tokens"] == sum(o for _, o in expected) == lmd["requested_output_tokens"]
    assert lmd["engine"]["generated_tokens"] == lmd["output_tokens"] and lmd["finish_reasons"] == {"length": 12}
    assert lmd["input_tokens"] == sum(p for p, _ in expected)
    hf = tiny["real"][script.HF]
    assert hf["requests"] == HF_REQUESTS and hf["output_tokens"] == sum(o for _, o in expected[:HF_REQUESTS])
    assert hf["padded_output_tokens"] >= hf["output_tokens"] and len(hf["batches"]) == 2  # batches of 4
    assert hf["output_tokens_per_s"] > 0 and tiny["real"]["ratios"]["lmd_over_hf"] > 0
    assert script.LMDEPLOY not in tiny["real"]  # --tiny runs no peer


def test_real_workload_again_with_int8_kv(script, report):
    real = report[0]["models"]["tiny"]["real"]
    lmd, int8 = real["lmd"], real[script.KV_INT8]
    assert int8["settings"]["engine_options"]["quant_policy"] == 4
    assert "quant_policy" not in lmd["settings"]["engine_options"]
    assert int8["requests"] == lmd["requests"] and int8["output_tokens"] == lmd["output_tokens"]
    assert real["ratios"]["kv_int8_over_lmd"] == pytest.approx(
        int8["output_tokens_per_s"] / lmd["output_tokens_per_s"])
    assert f"{script.KV_INT8}" in report[1] and "x lmd (float KV)" in report[1]


def test_kv_int8_gets_more_blocks_in_the_same_bytes(report):
    kv = report[0]["models"]["tiny"]["kv-int8"]
    assert kv["blocks"]["int8"] > kv["blocks"]["float"] == 256 // 16
    for label in ("float", "int8"):
        run = kv[label]
        assert run["settings"]["kv_blocks"] == kv["blocks"][label]
        assert run["requests"] == KV_REQUESTS and run["output_tokens"] == run["requested_output_tokens"]
        assert 0 < run["mean_running_batch"] <= run["max_running_batch"] <= 8
    assert kv["int8"]["settings"]["engine_options"]["quant_policy"] == 4
    assert kv["int8_over_float_requests_per_s"] > 0


def test_prefix_cache_serves_the_second_turns_only_when_on(report):
    prefix = report[0]["models"]["tiny"]["prefix"]
    for submit in ("sequential", "concurrent"):
        off, on = prefix["off"][submit], prefix["on"][submit]
        assert off["requests"] == on["requests"] == CONVERSATIONS
        assert off["prefix_hit_tokens"] == 0 == off["cached_tokens_usage"]
        assert on["prefix_hit_tokens"] > 0 and on["prefix_hit_tokens"] == on["cached_tokens_usage"]
        assert on["prefix_hit_tokens"] % 16 == 0  # whole blocks only
        assert off["computed_tokens"] - on["computed_tokens"] == on["prefix_hit_tokens"]
        assert on["output_tokens"] == CONVERSATIONS * prefix["turn2_output_len"]
        assert off["ttft_ms"]["count"] == on["ttft_ms"]["count"] == CONVERSATIONS


def test_out_of_budget_skips_and_says_so(script, lengths_file, tmp_path, capsys):
    script.main(["--tiny", "--lengths", str(lengths_file), "--out", str(tmp_path), "--budget-s", "0"])
    results = json.loads((tmp_path / "serving_workloads.json").read_text())
    assert results["models"]["tiny"]["skipped"].startswith("out of time")
    assert "skipped" in capsys.readouterr().out


def test_flags_are_checked(script):
    with pytest.raises(SystemExit):
        script.parse_args(["--workloads", "real,nope"])
    with pytest.raises(SystemExit):
        script.parse_args(["--limit-s", "real"])
    args = script.parse_args(["--limit-s", "real=240,prefix=30"])
    assert args.limits == {"real": 240.0, "prefix": 30.0} and args.hf_models == ["llama3-8b"]
    assert (args.num_requests, args.max_batch_size, args.hf_batch_size) == (1000, 256, 64)
    with pytest.raises(SystemExit, match="--no-peer"):
        script.parse_args(["--tp", "2"])
    with pytest.raises(SystemExit, match="at least 1"):
        script.parse_args(["--tp", "0", "--no-peer"])
    args = script.parse_args(["--tp", "2", "--no-peer"])
    shared = ("cuda", 2048, 256, 8192, 0.5, 64, 1024, 1024, 0)
    assert script.Settings(*shared, args.tp).engine_options("fp16")["tp"] == 2
    assert script.Settings(*shared).engine_options("fp16")["tp"] == 1
