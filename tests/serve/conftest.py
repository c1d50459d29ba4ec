"""A tiny random Llama workspace (SmolLM2's tokenizer and ChatML template), one running engine and its app."""

from __future__ import annotations

from pathlib import Path

import pytest

ENGINE_OPTIONS = dict(cache_block_seq_len=4, cache_max_entry_count=64, max_context_token_num=24, device="cpu")
MODEL = "tiny"


@pytest.fixture(scope="session")
def serve_ws(tiny_llama_ws) -> Path:
    return tiny_llama_ws[1]


@pytest.fixture(scope="module")
def engine(serve_ws):
    from lmd.turbomind.engine import Engine

    with Engine(serve_ws, **ENGINE_OPTIONS) as running:
        yield running


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from lmd.serve.app import create_app

    with TestClient(create_app(engine, MODEL)) as test_client:
        yield test_client


def sse_payloads(text: str) -> list[str]:
    """The `data:` payloads of an event stream, in order."""
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


@pytest.fixture(scope="module")
def openai_client(client):
    """The official client, talking to the in-process app through the TestClient (an httpx.Client)."""
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


@pytest.fixture()
def forced(engine, monkeypatch):
    """`forced(text)`: the next generations stream `text` three characters a delta (the tiny random model never
    writes a tool call or a <think> block); returns the prompts seen."""
    from lmd.turbomind.request_stream import Delta, RequestStream, Usage

    prompts: list[str] = []

    def force(text: str) -> list[str]:
        def generate(prompt_ids, config=None, request_id=None, apply_chat_template=True):
            prompts.append(engine.tokenizer.decode(prompt_ids))
            stream = RequestStream(request_id, lambda _: None)
            pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
            for piece in pieces:
                stream.put(Delta(request_id, piece, (1,)))
            stream.put(Delta(request_id, "", (), "stop", Usage(len(prompt_ids), len(pieces), 0)))
            return stream

        monkeypatch.setattr(engine, "generate", generate)
        return prompts

    return force
