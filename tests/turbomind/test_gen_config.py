from __future__ import annotations

import pytest

from lmd.errors import LmdError
from lmd.turbomind.gen_config import GenerationConfig


def test_defaults_sample_and_are_valid():
    config = GenerationConfig()
    assert (config.temperature, config.top_k, config.top_p, config.max_new_tokens) == (0.8, 40, 0.8, 512)
    assert not config.is_greedy


@pytest.mark.parametrize("kwargs", [{"temperature": 0}, {"temperature": 0.0, "top_k": 0}, {"top_k": 1}])
def test_is_greedy(kwargs):
    assert GenerationConfig(**kwargs).is_greedy


def test_lists_become_tuples_and_config_is_hashable():
    config = GenerationConfig(stop_token_ids=[7, 8], stop_words=["###", "User:"])
    assert config.stop_token_ids == (7, 8)
    assert config.stop_words == ("###", "User:")
    assert hash(config) == hash(GenerationConfig(stop_token_ids=(7, 8), stop_words=("###", "User:")))
    assert GenerationConfig(stop_words="END").stop_words == ("END",)
    assert GenerationConfig(stop_token_ids=None).stop_token_ids == ()


def test_frozen():
    with pytest.raises(AttributeError):
        GenerationConfig().temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -1),
        ("top_k", 2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_new_tokens", 0),
        ("min_new_tokens", -1),
        ("min_new_tokens", 600),
        ("seed", -3),
        ("seed", "42"),
        ("logprobs", -1),
        ("logprobs", 1000),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("stop_words", [""]),
        ("stop_words", [3]),
        ("ignore_eos", "yes"),
        ("max_new_tokens", True),
    ],
)
def test_invalid_values_raise_one_line_naming_the_field(field, value):
    with pytest.raises(LmdError) as info:
        GenerationConfig(**{field: value})
    message = str(info.value)
    assert f"GenerationConfig.{field}=" in message
    assert "use" in message and "\n" not in message


def test_valid_edges():
    GenerationConfig(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=0.5, min_new_tokens=512, seed=0, logprobs=0)
    GenerationConfig(temperature=2.0, top_p=1e-6, max_new_tokens=1, logprobs=64)
