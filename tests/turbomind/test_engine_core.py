"""The engine in its own process (`EngineClient`): the same streams as the in-process engine, requests refused in
the caller's process with the engine's messages, stats, aborts, close, and an engine process that fails to start or
dies is a clean error, never a hang."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.engine import Engine
from lmd.turbomind.engine_core import EngineClient
from lmd.turbomind.gen_config import GenerationConfig

OPTIONS = dict(cache_block_seq_len=4, cache_max_entry_count=64, max_batch_size=8)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 17, 9, 3)]


def _configs() -> list[GenerationConfig]:
    greedy = GenerationConfig(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    sampled = GenerationConfig(max_new_tokens=9, temperature=1.0, top_k=0, top_p=1.0, seed=3, ignore_eos=True)
    return [greedy, sampled, greedy, GenerationConfig(max_new_tokens=6, temperature=0, stop_words=["a"])]


def _responses(engine) -> list[tuple]:
    streams = [engine.generate(p, c, request_id=f"r{i}") for i, (p, c) in enumerate(zip(_prompts(), _configs(),
                                                                                          strict=True))]
    out = []
    for s in streams:
        r = s.result()
        out.append((r.request_id, r.text, r.token_ids, r.finish_reason, r.logprobs, r.usage))
    samples = engine.generate_samples(_prompts()[0], GenerationConfig(n=3, max_new_tokens=5, temperature=1.0, seed=7,
                                                                      ignore_eos=True), request_id="s")
    out += [(r.request_id, r.token_ids) for r in (s.result() for s in samples)]
    return out


@pytest.fixture(scope="module")
def client(tiny_llama_ws):
    with EngineClient(tiny_llama_ws[1], **OPTIONS) as engine:
        yield engine


def test_streams_equal_the_in_process_engine(tiny_llama_ws, client):
    with Engine(tiny_llama_ws[1], **OPTIONS) as local:
        expected = _responses(local)
    ours = _responses(client)
    # the child may run another number of intra-op threads: logprobs agree to float rounding, everything else exactly
    strip = lambda rows: [row[:4] + row[5:] if len(row) > 2 else row for row in rows]  # noqa: E731
    assert strip(ours) == strip(expected)
    for mine, theirs in zip(ours[:4], expected[:4], strict=True):
        assert (mine[4] is None) == (theirs[4] is None)
        if mine[4] is not None:
            assert mine[4] == pytest.approx(theirs[4], abs=1e-4)
    assert client.pid != os.getpid()
    assert client.max_len == local.max_len and client.eos_ids == local.eos_ids
    stats = client.stats()
    assert stats.blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert stats.generated_tokens >= 12 + 9 + 12 + 15


def test_requests_are_refused_in_the_callers_process(client):
    with pytest.raises(LmdError, match="the prompt is empty"):
        client.generate([])
    with pytest.raises(LmdError, match="tokens; this engine holds at most"):
        client.generate([1] * client.max_len)
    with pytest.raises(LmdError, match="batch slots"):
        client.generate_samples([1, 2], GenerationConfig(n=9))
    with pytest.raises(LmdError, match="call generate_samples"):
        client.generate([1, 2], GenerationConfig(n=2))
    stream = client.generate([1, 2, 3], GenerationConfig(max_new_tokens=200, ignore_eos=True), request_id="dup")
    with pytest.raises(LmdError, match="already running"):
        client.generate([4], request_id="dup")
    stream.abort()
    response = stream.result()
    assert response.finish_reason == "abort" and len(response.token_ids) < 200
    assert client.generate([4], GenerationConfig(max_new_tokens=2), request_id="dup").result().finish_reason


def test_async_streams_and_text_prompts(client):
    async def run() -> list[str]:
        streams = [client.generate(text, GenerationConfig(max_new_tokens=4, temperature=0)) for text in ("Hi", "Yo")]
        texts = []
        for stream in streams:
            texts.append("".join([d.text async for d in stream]))
        return texts

    texts = asyncio.run(run())
    expected = [client.generate(t, GenerationConfig(max_new_tokens=4, temperature=0)).result().text
                for t in ("Hi", "Yo")]
    assert texts == expected
    assert client.encode("Hi") == client.chat_template.encode([{"role": "user", "content": "Hi"}], client.tokenizer)


def test_close_aborts_running_requests(tiny_llama_ws):
    engine = EngineClient(tiny_llama_ws[1], **OPTIONS)
    stream = engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=100, ignore_eos=True))
    next(iter(stream))  # running
    engine.close()
    assert stream.result().finish_reason in ("abort", "length")
    with pytest.raises(LmdError, match="closed"):
        engine.generate([1])
    assert not engine._process.is_alive()


def test_an_engine_that_cannot_start_is_a_one_line_error(tiny_llama_ws, tmp_path):
    with pytest.raises(LmdError, match="max_batch_size=0"):
        EngineClient(tiny_llama_ws[1], max_batch_size=0)  # refused before any process starts
    broken = tmp_path / "ws"
    shutil.copytree(tiny_llama_ws[1], broken)
    for weights in (broken / "triton_models" / "weights").glob("model.rank*.safetensors"):
        weights.unlink()
    with pytest.raises(LmdError, match="not found"):
        EngineClient(broken)


def test_an_engine_process_that_dies_ends_its_streams_with_error(tiny_llama_ws):
    engine = EngineClient(tiny_llama_ws[1], **OPTIONS)
    stream = engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=40, ignore_eos=True))
    next(iter(stream))
    os.kill(engine.pid, signal.SIGKILL)
    assert stream.result().finish_reason == "error"
    assert "exited" in str(engine.last_error)
    with pytest.raises(LmdError, match="closed"):
        engine.generate([1])
    engine.close()


def test_speculative_engine_in_its_own_process(tiny_llama_ws):
    from lmd.turbomind.speculative.config import SpeculativeConfig

    spec = SpeculativeConfig("ngram")
    prompt, config = [3, 4, 5, 3, 4, 5, 3, 4], GenerationConfig(max_new_tokens=10, temperature=0, ignore_eos=True)
    with Engine(tiny_llama_ws[1], speculative=spec, **OPTIONS) as local:
        expected = local.generate(prompt, config).result().token_ids
    with EngineClient(tiny_llama_ws[1], speculative=spec, **OPTIONS) as engine:
        assert engine.generate(prompt, config).result().token_ids == expected
        with pytest.raises(LmdError, match="one sample per prompt"):  # refused in the caller's process
            engine.generate_samples(prompt, GenerationConfig(n=2))
