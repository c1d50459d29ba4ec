"""Request sampling: seeded determinism, length filters, output-length rules, synthetic prompts."""

from __future__ import annotations

import pytest

from lmd.bench.dataset import Conversation
from lmd.bench.sampling import BenchRequest, SamplingConfig, random_requests, sample_requests
from lmd.errors import LmdError


def encode(text: str) -> list[int]:
    """A fake tokenizer: one token per word, the id is the word's length (so lengths are easy to reason about)."""
    return [len(word) for word in text.split()]


def count(text: str) -> int:
    return len(text.split())


# prompt i has i + 1 words; every third conversation has a reply of 2 * i words
CONVERSATIONS = [
    Conversation(" ".join(["w"] * (i + 1)), " ".join(["r"] * (2 * i)) if i % 3 == 0 and i else None) for i in range(60)
]


def _sample(**kwargs) -> list[BenchRequest]:
    return sample_requests(CONVERSATIONS, encode, count, SamplingConfig(**kwargs))


def test_same_seed_same_sample_other_seed_other_sample():
    a, b = _sample(num_prompts=10, seed=3), _sample(num_prompts=10, seed=3)
    assert a == b
    assert [r.prompt_len for r in a] != [r.prompt_len for r in _sample(num_prompts=10, seed=4)]
    # a larger sample with the same seed starts with the smaller one (the seeded order is fixed, then filtered)
    assert _sample(num_prompts=20, seed=3)[:10] == a


def test_length_filters_and_output_rules():
    requests = _sample(num_prompts=20, seed=1, min_input_len=10, max_input_len=40, max_output_len=30)
    assert all(10 <= r.prompt_len <= 40 for r in requests)
    for r in requests:
        i = r.prompt_len - 1
        if i % 3 == 0:  # has a reply of 2i words: its length, capped, exactly
            assert (r.output_len, r.exact) == (min(2 * i, 30), True)
        else:  # no reply: up to max_output_len, EOS may end it
            assert (r.output_len, r.exact) == (30, False)
    fixed = _sample(num_prompts=20, seed=1, fixed_output_len=7)
    assert all((r.output_len, r.exact) == (7, True) for r in fixed)


def test_every_prompt_in_range_is_reachable_and_none_outside():
    got = _sample(num_prompts=31, seed=0, min_input_len=20, max_input_len=50)
    assert sorted(r.prompt_len for r in got) == list(range(20, 51))


def test_total_length_filter_and_too_few_prompts():
    got = _sample(num_prompts=12, seed=0, fixed_output_len=10, max_total_len=25)
    assert sorted(r.prompt_len for r in got) == list(range(4, 16))
    with pytest.raises(LmdError, match=r"only 12 of 60 prompts pass .*prompt \+ output <= 25.*lower --num-prompts"):
        _sample(num_prompts=13, seed=0, fixed_output_len=10, max_total_len=25)  # lengths 4..15 fit


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_prompts": 0}, "--num-prompts must be at least 1"),
        ({"min_input_len": 10, "max_input_len": 5}, "--max-input-len 5 is below --min-input-len 10"),
        ({"max_output_len": 0}, "--max-output-len must be at least 1"),
        ({"fixed_output_len": 0}, "--fixed-output-len must be at least 1"),
    ],
)
def test_bad_config(kwargs, message):
    with pytest.raises(LmdError, match=message):
        SamplingConfig(**kwargs)


def test_random_requests_exact_lengths_banned_ids_and_seeds():
    a = random_requests(6, input_len=33, output_len=5, vocab_size=10, seed=1, exclude=(0, 9))
    assert all(r.prompt_len == 33 and r.output_len == 5 and r.exact for r in a)
    assert all(0 < t < 9 for r in a for t in r.prompt_ids)
    assert a == random_requests(6, 33, 5, 10, seed=1, exclude=(0, 9))
    assert len({r.prompt_ids for r in a}) == 6
    assert a != random_requests(6, 33, 5, 10, seed=2, exclude=(0, 9))
    with pytest.raises(LmdError, match="leaves no token"):
        random_requests(1, 4, 4, vocab_size=2, exclude=(0, 1))
    with pytest.raises(LmdError, match="at least 1"):
        random_requests(1, 0, 4, vocab_size=10)


def test_real_tokenizer_with_chat_template(tokenizer):
    from lmd.chat_templates import get_chat_template

    template = get_chat_template("hf")
    conversations = [Conversation(f"Question number {i}: " + "why? " * i, None) for i in range(40)]
    requests = sample_requests(
        conversations,
        lambda t: template.encode([{"role": "user", "content": t}], tokenizer),
        lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"]),
        SamplingConfig(num_prompts=8, seed=5, min_input_len=40, max_input_len=60),
    )
    assert len(requests) == 8 and all(40 <= r.prompt_len <= 60 for r in requests)
    text = tokenizer.decode(requests[0].prompt_ids)
    assert text.startswith("<|im_start|>") and text.rstrip().endswith("<|im_start|>assistant")
