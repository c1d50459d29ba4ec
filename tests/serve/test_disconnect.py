"""A client that goes away mid-generation aborts its request: the engine frees its KV blocks.

The app is driven through raw ASGI messages and the engine stepped by hand (start=False), so the disconnect lands
at a known point: after some tokens, long before max_tokens.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.serve.conftest import ENGINE_OPTIONS, MODEL

LONG = {
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 200,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture()
def manual_engine(serve_ws):
    from lmd.turbomind.engine import Engine

    with Engine(serve_ws, start=False, **ENGINE_OPTIONS) as engine:
        yield engine


class _Connection:
    """One POST to the app; `disconnect()` is the client going away."""

    def __init__(self, app, path: str, body: dict) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.inbox.put_nowait({"type": "http.request", "body": json.dumps(body).encode(), "more_body": False})
        self.bodies: list[bytes] = []
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
            "client": ("127.0.0.1", 50000),
            "server": ("test", 80),
        }
        self.task = asyncio.ensure_future(app(scope, self.inbox.get, self._send))

    async def _send(self, message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            self.bodies.append(message["body"])

    def disconnect(self) -> None:
        self.inbox.put_nowait({"type": "http.disconnect"})


async def _step_until(engine, done, limit: int = 500) -> None:
    for _ in range(limit):
        if done():
            return
        engine.step()
        await asyncio.sleep(0.001)  # let the app's tasks take the deltas
    raise AssertionError("the condition never held")


def _disconnect_mid_generation(engine, stream: bool) -> tuple[int, str]:
    from lmd.serve.app import create_app

    app = create_app(engine, MODEL)
    total = engine.stats().blocks_total

    async def scenario() -> None:
        connection = _Connection(app, "/v1/chat/completions", {**LONG, "stream": stream})
        if stream:  # the role chunk, then at least two token chunks
            await _step_until(engine, lambda: len(connection.bodies) >= 3)
        else:
            await _step_until(engine, lambda: engine.stats().generated_tokens >= 3)
        stats = engine.stats()
        assert stats.running == 1 and stats.blocks_used > 0
        connection.disconnect()
        await asyncio.wait_for(connection.task, timeout=30)
        engine.step()  # the engine thread's next step applies the abort

    asyncio.run(scenario())
    stats = engine.stats()
    assert stats.running == stats.waiting == 0
    assert stats.blocks_used == 0 and stats.blocks_free == total
    metrics = app.state.server.counts.finished
    return stats.generated_tokens, dict(metrics)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_aborts_and_frees_blocks(manual_engine, stream):
    generated, finished = _disconnect_mid_generation(manual_engine, stream)
    assert generated < LONG["max_tokens"]
    assert finished == {("/v1/chat/completions", "abort"): 1}
