"""A tiny random Llama deployed with MODEL_NAME `hf` (SmolLM2's ChatML template), and engines over it."""

from __future__ import annotations

from pathlib import Path

import pytest

# Small KV blocks so the prefix cache works at the scale of a few-token conversation.
ENGINE_OPTIONS = dict(cache_block_seq_len=4, cache_max_entry_count=96, session_len=256, device="cpu")
BLOCK = ENGINE_OPTIONS["cache_block_seq_len"]


@pytest.fixture(scope="session")
def chat_model(tiny_llama_ws) -> tuple[Path, Path]:
    """(HF source dir, workspace dir); the SmolLM2 tokenizer gives it a chat template."""
    return tiny_llama_ws


@pytest.fixture(scope="session")
def chat_ws(chat_model) -> Path:
    return chat_model[1]


@pytest.fixture
def engine(chat_ws):
    from lmd.turbomind.engine import Engine

    with Engine(chat_ws, **ENGINE_OPTIONS) as eng:
        yield eng
