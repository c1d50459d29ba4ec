"""RequestStream hand-off between the engine thread and consumers (sync iterator, asyncio)."""

from __future__ import annotations

import asyncio

from lmd.turbomind.request_stream import Delta, RequestStream


def _delta(text: str, finish: str | None = None) -> Delta:
    return Delta("r", text, (1,), finish, None, None, None)


def test_deltas_before_async_iteration_are_not_lost():
    stream = RequestStream("r", abort=lambda rid: None)
    stream.put(_delta("a"))

    async def consume() -> list[str]:
        out = []
        async for d in stream:
            out.append(d.text)
            if d.text == "a":
                asyncio.get_running_loop().call_soon(stream.put, _delta("b", "stop"))
        return out

    assert asyncio.run(consume()) == ["a", "b"]


def test_put_after_the_consumer_loop_closed_aborts_once_and_never_raises():
    aborted = []
    stream = RequestStream("r", abort=aborted.append)

    async def read_first() -> str:
        async for d in stream:
            return d.text
        return ""

    loop = asyncio.new_event_loop()
    loop.call_soon(stream.put, _delta("a"))
    assert loop.run_until_complete(read_first()) == "a"
    loop.close()
    stream.put(_delta("b"))  # the engine thread keeps going
    stream.put(_delta("c"))
    stream.put(_delta("", "abort"))
    assert aborted == ["r"]
