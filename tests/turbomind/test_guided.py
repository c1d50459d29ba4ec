"""Structured outputs on SmolLM2's real tokenizer: constrained random walks through the bitmask always give text that
the grammar's own checker accepts (jsonschema, re.fullmatch, the choice list), and the pure-torch bitmask equals
xgrammar's kernel."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.guided import (
    GrammarCompiler,
    GuidedMatcher,
    GuidedSpec,
    InvalidGuide,
    allocate_bitmask,
    apply_bitmask,
    bitmask_words,
)

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

VOCAB = 49152
EOS = 2  # <|im_end|>, SmolLM2's eos and its chat template's end token
ENDOFTEXT = 0


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, (EOS,))


@pytest.fixture(scope="module")
def preferred(tokenizer) -> list[tuple[np.ndarray, float]]:
    """(tokens, chance) the walk picks from first when any is allowed, so that it ends in a few dozen steps: tokens
    holding a JSON closing or separating character, then one-character tokens (a regex's `@` among the letters)."""
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))] + [""] * (VOCAB - len(tokenizer))
    closing = np.array([any(ch in '"}],' for ch in text) for text in texts])
    single = np.array([len(text) == 1 for text in texts])
    return [(closing, 0.6), (single, 0.5)]


def allowed_tokens(matcher: GuidedMatcher, vocab: int = VOCAB) -> torch.Tensor:
    """The allowed ids, read back through apply_bitmask (so every walk also exercises it)."""
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, vocab)
    apply_bitmask(logits, bitmask, torch.tensor([0]))
    return logits[0] > float("-inf")


def walk(matcher: GuidedMatcher, seed: int, preferred: list[tuple[np.ndarray, float]],
         max_steps: int = 300) -> list[int]:
    """A seeded random walk of allowed tokens, up to and including the stop token."""
    rng = random.Random(seed)
    stops = np.zeros(VOCAB, dtype=bool)
    stops[list(matcher.stop_token_ids)] = True
    tokens: list[int] = []
    for _ in range(max_steps):
        allowed = allowed_tokens(matcher).numpy()
        assert allowed.any(), f"empty mask after {tokens}"
        for tier, chance in ((stops, 0.5), *preferred):
            if rng.random() < chance and (allowed & tier).any():
                allowed = allowed & tier
                break
        ids = np.flatnonzero(allowed)
        token = int(ids[rng.randrange(len(ids))])
        assert matcher.accept(token), token
        tokens.append(token)
        if matcher.is_terminated():
            return tokens
    raise AssertionError(f"no stop token after {max_steps} steps: {tokens}")


def walk_text(compiler: GrammarCompiler, tokenizer, spec: GuidedSpec, seed: int,
              preferred: list[tuple[np.ndarray, float]]) -> str:
    tokens = walk(compiler.matcher(spec), seed, preferred)
    assert tokens[-1] == EOS
    return tokenizer.decode(tokens[:-1], skip_special_tokens=True)


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1}, "email": {"type": "string", "maxLength": 12}},
        "required": ["id", "email"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
     "required": ["ok", "none"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 250}}, "required": ["n"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 5}},
     "required": ["word"]},
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                "required": ["x", "y"]}, "maxItems": 3},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
     "required": ["a"]},
    {"type": "object", "properties": {"version": {"const": "v1"}, "level": {"type": "integer"}},
     "required": ["version", "level"]},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "integer"}]}},
     "required": ["id"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"]},
    {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}, "maxItems": 3},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {"type": "object", "properties": {"size": {"enum": [1, 2.5, "big", None, True]}}, "required": ["size"]},
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 8}}, "required": ["note"]},
    {"type": "object", "properties": {"t": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
     "required": ["t"]},
    # xgrammar 0.2.9 ignores minLength/maxLength beside a pattern (it says so on stderr): the length is in the pattern
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                               "minItems": 2, "maxItems": 3}}, "required": ["tags"]},
    {"type": "string", "enum": ["yes", "no"]},
]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_random_walks_follow_the_json_schema(compiler, tokenizer, preferred, index):
    schema = SCHEMAS[index]
    spec = GuidedSpec.from_json_schema(schema)
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    for seed in range(3):
        text = walk_text(compiler, tokenizer, spec, seed * 100 + index, preferred)
        checker.validate(json.loads(text))


def test_json_object_is_any_object(compiler, tokenizer, preferred):
    for seed in range(4):
        assert isinstance(json.loads(walk_text(compiler, tokenizer, GuidedSpec("json_object"), seed, preferred)), dict)


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"(yes|no|maybe)",
                                     r"[A-F0-9]{2}(:[A-F0-9]{2}){2}", r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?"])
def test_random_walks_match_the_regex(compiler, tokenizer, preferred, pattern):
    for seed in range(3):
        assert re.fullmatch(pattern, walk_text(compiler, tokenizer, GuidedSpec("regex", pattern), seed, preferred))


def test_choices_are_exact_and_each_reachable(compiler, tokenizer, preferred):
    choices = ["Paris", "Lyon", "Saint-Étienne", 'say "hi"', "back\\slash", "two\nlines"]
    spec = GuidedSpec.from_choices(choices)
    seen = {walk_text(compiler, tokenizer, spec, seed, preferred) for seed in range(60)}
    assert seen == set(choices)


@pytest.mark.parametrize(("ebnf", "pattern"), [
    ('root ::= term ("+" term)*\nterm ::= [0-9]+', r"[0-9]+(\+[0-9]+)*"),
    ('root ::= "[" item ("," item)* "]"\nitem ::= "yes" | "no"', r"\[(yes|no)(,(yes|no))*\]"),
    ('root ::= greeting " " name\ngreeting ::= "Hello" | "Hi"\nname ::= [A-Z] [a-z]{1,5}',
     r"(Hello|Hi) [A-Z][a-z]{1,5}"),
])
def test_random_walks_follow_the_ebnf(compiler, tokenizer, preferred, ebnf, pattern):
    for seed in range(3):
        assert re.fullmatch(pattern, walk_text(compiler, tokenizer, GuidedSpec("grammar", ebnf), seed, preferred))


@pytest.mark.parametrize(("spec", "reason"), [
    (GuidedSpec("json_schema", '{"type": "nonsense"}'), "nonsense"),
    (GuidedSpec("json_schema", "[1]"), "object or bool"),
    (GuidedSpec("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), "minimum greater than maximum"),
    (GuidedSpec("json_schema", '{"$ref": "#/$defs/missing"}'), "missing"),
    (GuidedSpec("json_schema", "{not json"), "JSON"),
    (GuidedSpec("regex", "(ab"), "parenthesis"),
    (GuidedSpec("grammar", "root ::= undefined_rule"), "undefined_rule"),
    (GuidedSpec("grammar", 'start ::= "a"'), "root"),
    (GuidedSpec("choice", "[]"), "non-empty"),
    (GuidedSpec("choice", '["a", 1]'), "non-empty"),
])
def test_invalid_specs_raise_one_line(compiler, spec, reason):
    with pytest.raises(InvalidGuide) as caught:
        compiler.compile(spec)
    message = str(caught.value)
    assert isinstance(caught.value, LmdError) and caught.value.kind == spec.kind
    assert reason in message and "\n" not in message and "/project/" not in message
    with pytest.raises(InvalidGuide):  # a failure is not cached
        compiler.compile(spec)


def test_spec_checks_its_fields():
    with pytest.raises(LmdError, match="kind"):
        GuidedSpec("xml", "")  # type: ignore[arg-type]
    with pytest.raises(InvalidGuide, match="not valid JSON"):
        GuidedSpec.from_json_schema("{oops")
    # equal schemas, whatever their spacing, are one spec; the property order is kept (it orders the reply)
    assert GuidedSpec.from_json_schema('{"a": 1, "b": 2}') == GuidedSpec.from_json_schema({"a": 1, "b": 2})
    assert GuidedSpec.from_json_schema({"b": 1, "a": 2}).value == '{"b":1,"a":2}'


def test_compile_is_cached_lru_and_thread_safe(tokenizer, monkeypatch):
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,), max_cached=2)
    a, b, c = (GuidedSpec("regex", p) for p in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(GuidedSpec("regex", "a+")) is first
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent; c evicts b
    compiler.compile(c)
    assert compiler.compile(a) is first

    calls = []
    original = compiler._compile

    def counted(spec):
        calls.append(spec)
        return original(spec)

    monkeypatch.setattr(compiler, "_compile", counted)
    spec = GuidedSpec.from_json_schema(SCHEMAS[1])
    barrier = threading.Barrier(8)
    results = []

    def worker():
        barrier.wait()
        results.append(compiler.compile(spec))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 8 and all(r is results[0] for r in results)

    specs = [GuidedSpec.from_json_schema(schema) for schema in SCHEMAS[2:8]]
    compiled: dict[GuidedSpec, object] = {}
    threads = [threading.Thread(target=lambda s=spec: compiled.setdefault(s, compiler.compile(s))) for spec in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [compiled[spec].spec for spec in specs] == specs  # type: ignore[attr-defined]


def test_termination_allows_only_stop_tokens(compiler, tokenizer):
    matcher = compiler.matcher(GuidedSpec.from_json_schema({"type": "object", "properties": {"a": {"type": "string"}},
                                                            "required": ["a"]}), extra_stop_token_ids=(ENDOFTEXT,))
    assert matcher.stop_token_ids == (EOS, ENDOFTEXT)
    inside = allowed_tokens(matcher)
    assert not inside[[EOS, ENDOFTEXT]].any()
    for token in tokenizer.encode('{"a": "x'):
        assert matcher.accept(token)
    inside = allowed_tokens(matcher)
    special = sorted(set(tokenizer.all_special_ids) | set(range(17)))  # <|im_start|>, <repo_name>, ... never text
    assert not inside[special].any() and inside.sum() > 40000
    assert not matcher.accept(1)  # <|im_start|>
    for token in tokenizer.encode('"}'):
        assert matcher.accept(token)
    assert matcher.is_completed() and not matcher.is_terminated()
    assert allowed_tokens(matcher).nonzero().flatten().tolist() == [ENDOFTEXT, EOS]
    assert not matcher.accept(tokenizer.encode(" ")[0])
    assert matcher.accept(ENDOFTEXT) and matcher.is_terminated()
    # a request that goes on past its stop token (ignore_eos) keeps a mask of stop tokens, never an empty one
    assert allowed_tokens(matcher).nonzero().flatten().tolist() == [ENDOFTEXT, EOS]
    assert matcher.accept(EOS) and not matcher.accept(tokenizer.encode("a")[0])
    matcher.rollback(2)
    assert matcher.is_completed() and not matcher.is_terminated()

    sign_bit = 63  # bit 31 of word 1: the int32 sign bit
    matcher = compiler.matcher(GuidedSpec.from_choices(["yes"]), extra_stop_token_ids=(sign_bit, VOCAB + 5))
    assert matcher.stop_token_ids == (EOS, sign_bit)  # ids outside the vocabulary are dropped
    for token in tokenizer.encode("yes"):
        assert matcher.accept(token)
    assert matcher.accept(sign_bit) and matcher.is_terminated()
    assert allowed_tokens(matcher).nonzero().flatten().tolist() == [EOS, sign_bit]


def test_rollback_and_fork_restore_state(compiler, tokenizer):
    spec = GuidedSpec.from_json_schema(SCHEMAS[0])
    matcher = compiler.matcher(spec)
    prefix, rest = tokenizer.encode('{"name": "'), tokenizer.encode('Bob", "age": 4')
    for token in prefix:
        assert matcher.accept(token)
    at_prefix = allowed_tokens(matcher)
    forked = matcher.fork()
    for token in rest:
        assert matcher.accept(token)
    assert not torch.equal(allowed_tokens(matcher), at_prefix)
    assert torch.equal(allowed_tokens(forked), at_prefix)  # the fork did not move
    matcher.rollback(len(rest))
    assert torch.equal(allowed_tokens(matcher), at_prefix)


def test_json_strings_never_take_raw_control_characters(compiler, tokenizer):
    """xgrammar alone admits byte tokens like "\x00" or "\t" inside a JSON string, which strict parsers refuse
    (json.loads: "Invalid control character"); lmd's JSON masks leave them out. A regex may still ask for them."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    matcher = compiler.matcher(GuidedSpec.from_json_schema(schema))
    for token in tokenizer.encode('{"name": "', add_special_tokens=False):
        assert matcher.accept(token)
    allowed = allowed_tokens(matcher).nonzero().flatten().tolist()
    assert len(allowed) > 1000  # plenty of string content is allowed
    assert not [t for t in allowed if t != EOS and any(ord(ch) < 32 for ch in tokenizer.decode([t]))]
    tab = tokenizer.convert_tokens_to_ids("\u0109")  # byte-level BPE's "\t"
    regex = compiler.matcher(GuidedSpec("regex", "a\tb"))
    assert regex.accept(tokenizer.encode("a", add_special_tokens=False)[0])
    assert bool(allowed_tokens(regex)[tab])


def test_padded_vocabulary_never_allows_padding(tokenizer):
    padded = VOCAB + 64  # lm_head rows past the tokenizer (Phi-3 / DeepSeek pad theirs)
    compiler = GrammarCompiler(tokenizer, padded, (EOS,))
    matcher = compiler.matcher(GuidedSpec("json_object"))
    allowed = allowed_tokens(matcher, padded)
    assert allowed.shape == (padded,) and allowed[:VOCAB].any() and not allowed[VOCAB:].any()
    with pytest.raises(LmdError, match="do not cover"):
        matcher.fill_next_token_bitmask(allocate_bitmask(1, VOCAB), 0)


@pytest.mark.parametrize(("vocab", "dtype"), [(VOCAB, torch.float32), (1000, torch.float32), (77, torch.bfloat16)])
def test_apply_bitmask_equals_xgrammar(vocab, dtype):
    generator = torch.Generator().manual_seed(vocab)
    rows = 5
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, bitmask_words(vocab)), dtype=torch.int32, generator=generator)
    logits = torch.randn(rows, vocab, generator=generator).to(dtype)
    picked = [0, 2, 3]
    ours, theirs = logits.clone(), logits.clone()
    apply_bitmask(ours, bitmask, torch.tensor(picked))
    xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=picked)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[1, 4]], logits[[1, 4]])  # rows not picked are untouched
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    for every_row in (torch.arange(rows), None):
        full = logits.clone()
        apply_bitmask(full, bitmask, every_row)
        assert torch.equal(full, expected)


def test_apply_bitmask_checks_shapes():
    with pytest.raises(LmdError, match="words"):
        apply_bitmask(torch.zeros(2, 100), allocate_bitmask(2, 64), torch.tensor([0]))
    with pytest.raises(LmdError, match="one bitmask row per logits row"):
        apply_bitmask(torch.zeros(2, 64), allocate_bitmask(1, 64), torch.tensor([0]))
    logits = torch.zeros(2, 64)
    apply_bitmask(logits, allocate_bitmask(2, 64) * 0, torch.tensor([], dtype=torch.long))
    assert torch.equal(logits, torch.zeros(2, 64))


def test_lmd_runs_without_xgrammar(tiny_llama_ws):
    """The GPU machine has no xgrammar: the engine, the server and unguided requests import and run without it; a
    guided request is an LmdError at generate time."""
    code = """
import sys
sys.modules["xgrammar"] = None
import torch
import lmd, lmd.turbomind.engine, lmd.turbomind.sampler, lmd.serve.app
from lmd.errors import LmdError
from lmd.serve.structured_outputs import structured_output
from lmd.turbomind.guided import GrammarCompiler, GuidedSpec, allocate_bitmask, apply_bitmask
assert structured_output(response_format={"type": "json_object"}).spec == GuidedSpec("json_object")
logits = torch.zeros(1, 40)
apply_bitmask(logits, allocate_bitmask(1, 40) * 0, torch.tensor([0]))
assert (logits == float("-inf")).all()
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig
engine = Engine(WORKSPACE, start=False, cache_block_seq_len=4, max_context_token_num=24,
                cache_max_entry_count=64)
stream = engine.generate([5, 6, 7], GenerationConfig(max_new_tokens=4, temperature=0, ignore_eos=True))
while engine.step():
    pass
assert len(stream.result().token_ids) == 4
for attempt in (lambda: engine.grammar_compiler.compile(GuidedSpec("regex", "a")),
                lambda: engine.generate([5, 6, 7], GenerationConfig(guided=GuidedSpec("json_object")))):
    try:
        attempt()
    except LmdError as exc:
        assert "pip install xgrammar" in str(exc), exc
    else:
        raise AssertionError("a grammar without xgrammar")
assert "xgrammar" not in [m for m, v in sys.modules.items() if v is not None]
""".replace("WORKSPACE", repr(str(tiny_llama_ws[1])))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
