"""Structured outputs through the engine on a tiny random model: the grammar alone makes its replies valid. Guided
rows share batches with unguided ones, under greedy and sampled decoding, stepped one by one and overlapped, and
through preemption; the reply ends with finish "stop" as soon as the grammar is complete."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.guided import GuidedSpec

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer",
                                      "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 2,
                                      "items": {"enum": ["a", "b"]}}}, "required": ["ok", "tags"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
]
OPTIONS = dict(cache_block_seq_len=4, max_context_token_num=24)


def _prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 3, 12, 7, 21)[:count]]


def _run(ws, configs: list[GenerationConfig], async_output: bool, **options) -> tuple[list, Engine]:
    engine = Engine(ws, start=False, async_output=async_output, **{**OPTIONS, "cache_max_entry_count": 64, **options})
    streams = [engine.generate(p, c, request_id=i) for i, (p, c) in enumerate(zip(_prompts(len(configs)), configs,
                                                                                   strict=True))]
    while engine.step():
        pass
    return [s.result() for s in streams], engine


def _json_config(schema: dict, **sampling) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=120, guided=GuidedSpec.from_json_schema(schema), **sampling)


@pytest.mark.parametrize("async_output", [False, True])
def test_guided_rows_beside_unguided_ones_are_valid_json(tiny_llama_ws, async_output):
    greedy, sampled = dict(temperature=0), dict(temperature=1.0, top_k=0, top_p=1.0, seed=11)
    configs = [_json_config(SCHEMAS[0], **greedy), GenerationConfig(max_new_tokens=9, temperature=0, ignore_eos=True),
               _json_config(SCHEMAS[1], **sampled), _json_config(SCHEMAS[2], **greedy),
               GenerationConfig(max_new_tokens=7, temperature=0.8, seed=2, ignore_eos=True),
               _json_config(SCHEMAS[3], **sampled, repetition_penalty=1.2, logprobs=1)]
    results, engine = _run(tiny_llama_ws[1], configs, async_output)
    for config, result in zip(configs, results, strict=True):
        if config.guided is None:
            assert result.finish_reason == "length" and len(result.token_ids) == config.max_new_tokens
            continue
        assert result.finish_reason == "stop", result.text
        assert result.token_ids[-1] in engine.eos_ids  # the grammar's only choice once it is complete
        jsonschema.validate(json.loads(result.text), json.loads(config.guided.value))
    assert engine.stats().blocks_used == 0


def test_overlapped_guided_streams_equal_step_by_step(tiny_llama_ws):
    """The overlapped engine builds each step's rows after the previous ids are accepted: same tokens, same text."""
    configs = [_json_config(s, temperature=0.9, seed=i) for i, s in enumerate(SCHEMAS)]
    configs.append(GenerationConfig(max_new_tokens=10, temperature=0, ignore_eos=True))
    ours, _ = _run(tiny_llama_ws[1], configs, True)
    ref, _ = _run(tiny_llama_ws[1], configs, False)
    assert [(r.text, r.token_ids, r.finish_reason) for r in ours] == [(r.text, r.token_ids, r.finish_reason)
                                                                      for r in ref]


def test_unguided_rows_are_what_they_were_without_guided_neighbours(tiny_llama_ws):
    plain = GenerationConfig(max_new_tokens=8, temperature=0, ignore_eos=True)
    alone, _ = _run(tiny_llama_ws[1], [plain, plain], True)
    mixed, _ = _run(tiny_llama_ws[1], [plain, _json_config(SCHEMAS[0], temperature=0)], True)
    assert mixed[0].token_ids == alone[0].token_ids


@pytest.mark.parametrize(("spec", "check"), [
    (GuidedSpec("regex", r"[a-z]{2,5}-\d{2}"), lambda text: re.fullmatch(r"[a-z]{2,5}-\d{2}", text)),
    (GuidedSpec.from_choices(["Paris", "Lyon", "Saint-Étienne"]), lambda text: text in {"Paris", "Lyon",
                                                                                        "Saint-Étienne"}),
    (GuidedSpec("grammar", 'root ::= "(" [0-9] ("+" [0-9])* ")"'), lambda text: re.fullmatch(r"\(\d(\+\d)*\)", text)),
])
def test_regex_choice_and_grammar_are_exact(tiny_llama_ws, spec, check):
    configs = [GenerationConfig(max_new_tokens=60, guided=spec, **sampling)
               for sampling in (dict(temperature=0), dict(temperature=1.0, top_k=0, top_p=1.0, seed=5))]
    results, _ = _run(tiny_llama_ws[1], configs, True)
    for result in results:
        assert result.finish_reason == "stop" and check(result.text), result.text


def test_json_object_after_logit_bias(tiny_llama_ws):
    """Any object: its strings are unbounded, which a random model fills until max_tokens; logit_bias (applied before
    the grammar) favours '"', '":', '0' and '}', and the grammar picks the ones that fit."""
    bias = {18: 60.0, 1799: 60.0, 32: 60.0, 109: 60.0}
    configs = [GenerationConfig(max_new_tokens=40, guided=GuidedSpec("json_object"), logit_bias=bias, **sampling)
               for sampling in (dict(temperature=0), dict(temperature=1.0, seed=5))]
    for result in _run(tiny_llama_ws[1], configs, True)[0]:
        assert result.finish_reason == "stop" and isinstance(json.loads(result.text), dict), result.text


def test_a_preempted_guided_request_still_gives_valid_json(tiny_llama_ws, monkeypatch):
    """The matcher lives on the request, not on its KV: recomputing the KV after preemption leaves it as it is."""
    admitted = []
    admit = Engine._admit
    monkeypatch.setattr(Engine, "_admit", lambda self, states: admitted.extend(states) or admit(self, states))
    configs = [GenerationConfig(max_new_tokens=30, temperature=0, ignore_eos=True) for _ in range(2)]
    configs += [_json_config(SCHEMAS[i % 2], temperature=0.7, seed=i) for i in range(4)]
    results, _ = _run(tiny_llama_ws[1], configs, True, cache_max_entry_count=16)  # 64 tokens of KV
    assert any(state.seq.num_preemptions for state in admitted[2:])
    for config, result in zip(configs[2:], results[2:], strict=True):
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), json.loads(config.guided.value))


def test_max_tokens_and_stop_strings_still_apply(tiny_llama_ws):
    spec = GuidedSpec.from_json_schema({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                       "minItems": 6})
    cut = GenerationConfig(max_new_tokens=3, temperature=0, guided=spec)
    stopped = GenerationConfig(max_new_tokens=60, temperature=0, guided=spec, stop_words=[","])
    (by_length, by_stop), _ = _run(tiny_llama_ws[1], [cut, stopped], True)
    assert by_length.finish_reason == "length" and len(by_length.token_ids) == 3  # cut JSON, as OpenAI gives
    assert by_stop.finish_reason == "stop" and "," not in by_stop.text and by_stop.text.startswith("[")


def test_ignore_eos_keeps_to_stop_tokens_after_the_grammar(tiny_llama_ws):
    spec = GuidedSpec.from_choices(["yes", "no"])
    (result,), engine = _run(tiny_llama_ws[1], [GenerationConfig(max_new_tokens=12, temperature=0, guided=spec,
                                                                 ignore_eos=True)], True)
    assert result.finish_reason == "length" and result.text in ("yes", "no")
    first_stop = next(i for i, t in enumerate(result.token_ids) if t in engine.eos_ids)
    assert all(t in engine.eos_ids for t in result.token_ids[first_stop:])


def test_guided_config_errors_come_at_generate_time(tiny_llama_ws):
    engine = Engine(tiny_llama_ws[1], start=False, **OPTIONS, cache_max_entry_count=64)
    with pytest.raises(LmdError, match="the regex is invalid"):
        engine.generate([1, 2, 3], GenerationConfig(guided=GuidedSpec("regex", "(unclosed")))
    assert not engine.scheduler.has_work()
    with pytest.raises(LmdError, match="min_new_tokens=2 is invalid; use 0 with a structured output"):
        GenerationConfig(min_new_tokens=2, guided=GuidedSpec("json_object"))
    with pytest.raises(LmdError, match="GenerationConfig.guided="):
        GenerationConfig(guided='{"type": "object"}')  # type: ignore[arg-type]


def test_a_refused_token_ends_the_request_with_an_error(tiny_llama_ws, monkeypatch):
    """Should the grammar refuse a sampled token (a bug), the request ends with "error"; the engine goes on."""
    from lmd.turbomind.guided import GuidedMatcher

    monkeypatch.setattr(GuidedMatcher, "accept", lambda self, token: False)
    configs = [GenerationConfig(max_new_tokens=5, temperature=0, guided=GuidedSpec("json_object")),
               GenerationConfig(max_new_tokens=4, temperature=0, ignore_eos=True)]
    (refused, plain), engine = _run(tiny_llama_ws[1], configs, True)
    assert refused.finish_reason == "error" and refused.text == "" and len(refused.token_ids) == 1
    assert plain.finish_reason == "length" and engine.stats().blocks_used == 0

