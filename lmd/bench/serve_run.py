"""`lmd bench serve`'s load: the same requests sent to an OpenAI-compatible server once per concurrency limit.

Arrivals follow vLLM's `--request-rate` / `--burstiness`: gaps drawn from a gamma distribution with mean
1 / rate (burstiness 1 is a Poisson process; below 1 burstier, above 1 more regular); rate inf sends every request
at once. A concurrency limit then holds a request back until one of the limit's slots is free; its clock starts
when it is sent, so that wait is not part of its TTFT (as in vLLM). Each limit runs the whole request list.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmd.bench.http_stream import Clock, ServedRequest, stream_request
from lmd.bench.sampling import BenchRequest
from lmd.bench.stats import Summary, summarize
from lmd.errors import LmdError

if TYPE_CHECKING:
    import httpx

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)


@dataclass(frozen=True)
class ServeTarget:
    base_url: str  # scheme://host:port[/prefix], without /v1
    endpoint: str
    model: str
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise LmdError(f"--endpoint {self.endpoint} is unknown; use {' or '.join(ENDPOINTS)}")
        if not self.timeout_s > 0:
            raise LmdError(f"--request-timeout must be above 0 seconds (got {self.timeout_s})")

    @property
    def url(self) -> str:
        return self.base_url + self.endpoint

    @property
    def chat(self) -> bool:
        return self.endpoint == CHAT

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class LoadConfig:
    max_concurrency: tuple[int | None, ...] = (None,)  # one run per entry; None: no limit
    request_rate: float = math.inf  # requests/s
    burstiness: float = 1.0
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise LmdError(f"--request-rate must be above 0 requests/s, or inf (got {self.request_rate})")
        if not self.burstiness > 0:
            raise LmdError(f"--burstiness must be above 0 (got {self.burstiness}); 1 is a Poisson process")


@dataclass(frozen=True)
class ServeRun:
    records: list[ServedRequest]  # in request order
    total_s: float  # first send to the last request's end
    max_concurrency: int | None
    max_in_flight: int  # the most requests sent and not yet finished at once

    @property
    def completed(self) -> list[ServedRequest]:
        return [r for r in self.records if r.ok]

    @property
    def errors(self) -> dict[str, int]:
        return dict(Counter(r.error for r in self.records if r.error is not None))

    @property
    def input_tokens(self) -> int:
        return sum(r.prompt_len for r in self.completed)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.completed)

    def per_s(self, amount: float) -> float:
        return amount / self.total_s if self.total_s > 0 else 0.0

    def ttft(self) -> Summary | None:
        return summarize([r.ttft for r in self.completed if r.ttft is not None])

    def tpot(self) -> Summary | None:
        return summarize([r.tpot for r in self.completed if r.tpot is not None])

    def inter_token(self) -> Summary | None:
        return summarize([gap for r in self.completed for gap in r.inter_chunk])

    def latency(self) -> Summary | None:
        return summarize([r.latency for r in self.completed])


def request_body(
    target: ServeTarget, request: BenchRequest, prompt: Callable[[], str], temperature: float, seed: int
) -> dict[str, Any]:
    """Completions send the prompt's token ids (exactly the offline benchmark's prompt); chat sends `prompt()`, its
    text, as one user turn for the server's template. `ignore_eos` (a vLLM / SGLang / lmd extension) is sent only
    where the length is exact."""
    body: dict[str, Any] = {
        "model": target.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": request.output_len,
        "temperature": temperature,
    }
    if target.chat:
        body["messages"] = [{"role": "user", "content": prompt()}]
    else:
        body["prompt"] = list(request.prompt_ids)
    if request.exact:
        body["ignore_eos"] = True
    if temperature > 0:
        body["seed"] = seed
    return body


def run_serve(
    target: ServeTarget,
    requests: Sequence[BenchRequest],
    bodies: Sequence[dict[str, Any]],
    load: LoadConfig,
    on_done: Callable[[ServedRequest], None] | None = None,
    clock: Clock = time.perf_counter,
) -> list[ServeRun]:
    """One test request (max_tokens 1: a wrong model, endpoint or key fails here in one line), then one run per
    concurrency limit."""
    if not requests:
        raise LmdError("no requests to run; raise --num-prompts")
    return asyncio.run(_sweep(target, requests, bodies, load, on_done, clock))


async def _sweep(
    target: ServeTarget,
    requests: Sequence[BenchRequest],
    bodies: Sequence[dict[str, Any]],
    load: LoadConfig,
    on_done: Callable[[ServedRequest], None] | None,
    clock: Clock,
) -> list[ServeRun]:
    import httpx

    unlimited = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(target.timeout_s, connect=min(target.timeout_s, 30.0))
    async with httpx.AsyncClient(headers=target.headers, timeout=timeout, limits=unlimited) as client:
        test = await stream_request(client, target.url, {**bodies[0], "max_tokens": 1}, requests[0].prompt_len, clock)
        if not test.ok:
            raise LmdError(
                f"the test request to {target.url} failed ({test.error}); check --model, --endpoint and the server's log"
            )
        lens = [r.prompt_len for r in requests]
        return [
            await _run_level(client, target.url, bodies, lens, limit, load, on_done, clock)
            for limit in load.max_concurrency
        ]


async def _run_level(
    client: httpx.AsyncClient,
    url: str,
    bodies: Sequence[dict[str, Any]],
    prompt_lens: Sequence[int],
    limit: int | None,
    load: LoadConfig,
    on_done: Callable[[ServedRequest], None] | None,
    clock: Clock,
) -> ServeRun:
    slots = asyncio.Semaphore(limit) if limit is not None else contextlib.nullcontext()
    in_flight = max_in_flight = 0

    async def send(i: int) -> ServedRequest:
        nonlocal in_flight, max_in_flight
        async with slots:
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                record = await stream_request(client, url, bodies[i], prompt_lens[i], clock)
            finally:
                in_flight -= 1
        if on_done is not None:
            on_done(record)
        return record

    start = clock()
    schedule = arrivals(len(bodies), load.request_rate, load.burstiness, load.seed)
    tasks = [asyncio.create_task(send(i)) async for i in schedule]
    records = await asyncio.gather(*tasks)
    return ServeRun(list(records), clock() - start, limit, max_in_flight)


async def arrivals(count: int, rate: float, burstiness: float, seed: int) -> AsyncIterator[int]:
    """Request indices 0..count-1, each yielded at its arrival time (see the module doc)."""
    rng = random.Random(seed)
    for i in range(count):
        yield i
        if math.isfinite(rate) and i + 1 < count:
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
