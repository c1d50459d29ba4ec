"""A tiny random Llama workspace (ChatML template, real SmolLM2 tokenizer) and a started engine over it."""

from __future__ import annotations

from pathlib import Path

import pytest

# Small blocks and a small prefill budget so a handful of requests already exercises batching and chunking.
ENGINE_OPTIONS = dict(
    device="cpu",
    cache_block_seq_len=8,
    cache_max_entry_count=256,
    max_context_token_num=64,
    max_batch_size=8,
    session_len=256,
)


@pytest.fixture(scope="session")
def bench_ws(tiny_llama_ws) -> Path:
    return tiny_llama_ws[1]


@pytest.fixture(scope="module")
def engine(bench_ws):
    from lmd.turbomind.engine import Engine

    with Engine(bench_ws, **ENGINE_OPTIONS) as eng:
        yield eng


@pytest.fixture(scope="module")
def server_url(engine):
    """`lmd serve`'s app over `engine`, on a free port, as model `tiny`."""
    from tests.bench.served import served

    with served(engine) as url:
        yield url
