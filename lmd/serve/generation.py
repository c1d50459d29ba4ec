"""Running one HTTP request's prompts in the engine: all submitted at once (so they batch), read back together.

A request with several prompts (a batched /v1/completions) is one engine request per prompt, with ids derived from
the response id; their deltas are merged into one stream tagged with the prompt's position.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.request_stream import Delta, RequestStream, Response, Usage


def engine_request_ids(response_id: str, count: int) -> list[str]:
    """One prompt keeps the response id as its engine id; a batch numbers them."""
    return [response_id] if count == 1 else [f"{response_id}-{i}" for i in range(count)]


def submit(engine: Engine, prompts: Sequence[list[int]], configs: Sequence[GenerationConfig],
           request_ids: Sequence[str]) -> list[RequestStream]:
    """Queue every prompt before reading any, so the engine schedules them in one batch; if one is refused, the
    ones already queued are aborted and the error propagates. Several samples of a prompt (n, best_of) are forked
    from one prefill: its streams follow one another, prompt by prompt."""
    streams: list[RequestStream] = []
    try:
        for ids, config, request_id in zip(prompts, configs, request_ids, strict=True):
            if config.num_samples == 1:
                streams.append(engine.generate(ids, config, request_id=request_id))
            else:
                streams.extend(engine.generate_samples(ids, config, request_id=request_id))
    except BaseException:
        for stream in streams:
            stream.abort()
        raise
    return streams


async def collect(stream: RequestStream) -> Response:
    response = Response(stream.request_id)
    async for delta in stream:
        response.add(delta)
    return response


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, Delta]]:
    """(prompt index, delta) in arrival order until every stream has finished."""
    if len(streams) == 1:  # the common case needs no queue or tasks
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        async for delta in stream:
            await queue.put((index, delta))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, delta = await queue.get()
            if delta.finish_reason is not None:
                remaining -= 1
            yield index, delta
    finally:
        for task in tasks:
            task.cancel()


def summed_usage(usages: Sequence[Usage | None], samples: int = 1) -> Usage | None:
    """Over the streams of a request, `samples` per prompt in a row: each prompt's tokens count once (its samples
    share one prefill), every sample's completion tokens count."""
    present = [u for u in usages if u is not None]
    if not present:
        return None
    prompts: list[Usage] = []  # one usage per prompt (its first sample that reported one)
    for start in range(0, len(usages), samples):
        prompts += [u for u in usages[start:start + samples] if u is not None][:1]
    return Usage(sum(u.prompt_tokens for u in prompts), sum(u.completion_tokens for u in present),
                 sum(u.cached_tokens for u in prompts))
