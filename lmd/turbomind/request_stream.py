"""What a caller gets back from `Engine.generate`: a stream of deltas, iterable synchronously or asynchronously.

The engine thread `put`s deltas; the caller reads them with `for delta in stream` or `async for delta in stream`.
The last delta has a finish_reason ("stop", "length", "abort" or "error").
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from lmd.turbomind.request_times import RequestTimes


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


PromptEntry = tuple[float, tuple[tuple[int, float], ...]] | None  # (logprob, top alternatives); None: first token


@dataclass(frozen=True)
class Delta:
    request_id: object
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[float, ...] | None = None  # of each token in token_ids (when the request asked for logprobs)
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    prompt_logprobs: tuple[PromptEntry, ...] | None = None  # once, in a request's first delta (prompt_logprobs set)
    times: RequestTimes | None = None  # in the final delta: when the request was queued, scheduled, ... finished


def best_by_logprob(responses: list[Response], n: int) -> list[Response]:
    """best_of: the n responses with the highest cumulative logprob (the sum over their tokens), best first; n samples
    without best_of (as many responses as wanted) stay in their order."""
    if n >= len(responses):
        return list(responses)
    return sorted(responses, key=lambda r: -sum(r.logprobs or ()))[:n]


@dataclass
class Response:
    """A whole generation, gathered from its deltas."""

    request_id: object
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    prompt_logprobs: list[PromptEntry] | None = None
    times: RequestTimes | None = None

    def add(self, delta: Delta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = list(delta.prompt_logprobs)
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        if delta.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + list(delta.top_logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.usage = delta.usage or self.usage
        self.times = delta.times or self.times


class RequestStream:
    def __init__(self, request_id: object, abort: Callable[[object], None]) -> None:
        self.request_id = request_id
        self._abort = abort
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_queue: asyncio.Queue[Delta] | None = None
        self._orphaned = False
        self._sink: Callable[[Delta], None] | None = None

    def put(self, delta: Delta) -> None:
        """Called from the engine thread. Never raises: a consumer whose event loop has closed gets its request
        aborted (once) and its remaining deltas dropped, so one dead client cannot stop the engine loop."""
        put_many([(self, delta)])

    def _route(self, delta: Delta) -> asyncio.AbstractEventLoop | None:
        """Hand `delta` to a sink or the synchronous queue; or return the event loop it must be scheduled on (the
        caller then does, with `_async_queue.put_nowait`)."""
        with self._lock:
            if self._sink is not None:
                self._sink(delta)
            elif self._loop is None:
                self._queue.put(delta)
            elif not self._orphaned:
                return self._loop
        return None

    def _orphan(self, delta: Delta) -> None:
        with self._lock:
            first = not self._orphaned
            self._orphaned = True
        if first and delta.finish_reason is None:
            self._abort(self.request_id)

    def abort(self) -> None:
        self._abort(self.request_id)

    def forward(self, sink: Callable[[Delta], None]) -> None:
        """Every delta, those already here first, goes to `sink` (called on the engine thread; it must not block)
        instead of to a reader of this stream: the engine-core process ships them to the client's streams."""
        with self._lock:
            while not self._queue.empty():
                sink(self._queue.get())
            self._sink = sink

    def __iter__(self) -> Iterator[Delta]:
        while True:
            delta = self._queue.get()
            yield delta
            if delta.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[Delta]:
        with self._lock:  # from now on deltas go to the event loop; move what already arrived
            self._loop = asyncio.get_running_loop()
            self._async_queue = asyncio.Queue()
            while not self._queue.empty():
                self._async_queue.put_nowait(self._queue.get())
        while True:
            delta = await self._async_queue.get()
            yield delta
            if delta.finish_reason is not None:
                return

    def result(self) -> Response:
        """Block until the request finishes; the whole response."""
        response = Response(self.request_id)
        for delta in self:
            response.add(delta)
        return response


def put_many(items: list[tuple[RequestStream, Delta]]) -> None:
    """Deliver one engine step's deltas, in order: those for streams read on an event loop go there in one
    `call_soon_threadsafe` per loop (one wake-up of the loop a step, not one per request: ~110 socket writes a step
    at a full batch otherwise, docs/benchmarks.md). Never raises (see `RequestStream.put`)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Delta]]] = {}
    for stream, delta in items:
        loop = stream._route(delta)
        if loop is not None:
            by_loop.setdefault(loop, []).append((stream, delta))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # "Event loop is closed"
            for stream, delta in batch:
                stream._orphan(delta)


def _deliver(batch: list[tuple[RequestStream, Delta]]) -> None:
    for stream, delta in batch:
        stream._async_queue.put_nowait(delta)  # type: ignore[union-attr]
