"""RequestStream hand-off between the engine thread and consumers (sync iterator, asyncio)."""

from __future__ import annotations

import asyncio

from lmd.turbomind import request_stream
from lmd.turbomind.request_stream import Delta, RequestStream, put_many


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


def test_one_steps_deltas_reach_every_stream_in_order_with_one_wake_up_per_loop(monkeypatch):
    streams = [RequestStream(f"r{i}", abort=lambda rid: None) for i in range(3)]
    sync = RequestStream("sync", abort=lambda rid: None)  # read without an event loop: its queue, no wake-up
    sink: list[str] = []
    forwarded = RequestStream("fwd", abort=lambda rid: None)
    forwarded.forward(lambda d: sink.append(d.text))
    calls = []

    async def consume(stream: RequestStream) -> list[str]:
        out = []
        async for d in stream:
            out.append(d.text)
        return out

    async def main() -> list[list[str]]:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a: calls.append(a) or real(*a))
        tasks = [asyncio.ensure_future(consume(s)) for s in streams]
        await asyncio.sleep(0)  # every consumer is iterating: deltas now go through the loop
        steps = [[(s, _delta(f"{i}{t}")) for i, s in enumerate(streams)] for t in "ab"]
        steps.append([(s, _delta(f"{i}c", "stop")) for i, s in enumerate(streams)])

        def engine() -> None:
            for step in steps:
                put_many(step + [(sync, _delta("s")), (forwarded, _delta("f"))])

        await asyncio.to_thread(engine)
        return list(await asyncio.gather(*tasks))

    assert asyncio.run(main()) == [[f"{i}a", f"{i}b", f"{i}c"] for i in range(3)]
    deliveries = [c for c in calls if c[0] is request_stream._deliver]
    assert len(deliveries) == 3  # one wake-up per step for the three async streams (to_thread adds its own)
    assert [d.text for d in (sync._queue.get() for _ in range(3))] == ["s"] * 3 and sink == ["f"] * 3


def test_put_many_to_a_closed_loop_aborts_the_unfinished_requests_once():
    aborted = []
    streams = [RequestStream(f"r{i}", abort=aborted.append) for i in range(2)]

    async def read_first(stream: RequestStream) -> str:
        async for d in stream:
            return d.text
        return ""

    loop = asyncio.new_event_loop()
    for s in streams:
        loop.call_soon(s.put, _delta("a"))
        assert loop.run_until_complete(read_first(s)) == "a"
    loop.close()
    put_many([(streams[0], _delta("b")), (streams[1], _delta("b", "stop"))])
    put_many([(streams[0], _delta("c")), (streams[1], _delta("c"))])
    assert aborted == ["r0"]  # r1's first dropped delta was its last: nothing to abort
