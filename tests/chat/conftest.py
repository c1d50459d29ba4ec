"""A tiny random Llama deployed with MODEL_NAME `hf` (SmolLM2's ChatML template), and engines over it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.turbomind.conftest import deploy_tiny

# Small KV blocks so the prefix cache works at the scale of a few-token conversation.
ENGINE_OPTIONS = dict(cache_block_seq_len=4, cache_max_entry_count=96, session_len=256, device="cpu")
BLOCK = ENGINE_OPTIONS["cache_block_seq_len"]


@pytest.fixture(scope="session")
def chat_model(tokenizer, tmp_path_factory) -> tuple[Path, Path]:
    """(HF source dir, workspace dir); needs the SmolLM2 tokenizer for its chat template."""
    return deploy_tiny(tmp_path_factory.mktemp("chat-tiny-llama"), "llama", model_name="hf")


@pytest.fixture(scope="session")
def chat_ws(chat_model) -> Path:
    return chat_model[1]


@pytest.fixture
def engine(chat_ws):
    from lmd.turbomind.engine import Engine

    with Engine(chat_ws, **ENGINE_OPTIONS) as eng:
        yield eng
