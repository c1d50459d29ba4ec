"""One streamed request to an OpenAI-compatible server, timed as vLLM's and SGLang's serving benchmarks time it.

TTFT runs from sending the request to the first chunk that carries text (chat streams open with an empty role
chunk, which does not count). Output tokens come from the server's `usage` (asked for with `stream_options`), or,
when a server sends none, from the number of text chunks. A request fails (`error` set) on a connection error, a
non-200 answer, an `error` event, a finish reason of abort/error, or a stream that stops before `[DONE]`; nothing
here raises, so one bad request never stops a run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

Clock = Callable[[], float]
FAILED_REASONS = ("abort", "error")


@dataclass(frozen=True)
class ServedRequest:
    prompt_len: int  # usage.prompt_tokens, or the client's own count when the server sent no usage
    submitted: float
    chunk_times: tuple[float, ...]  # arrival of each chunk that carried text
    finished: float
    output_tokens: int
    usage_reported: bool  # False: output_tokens counts text chunks (a chunk may hold several tokens)
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens (prefix cache), 0 when not reported
    finish_reason: str | None
    error: str | None = None  # why the request failed; None when it succeeded

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency(self) -> float:
        return self.finished - self.submitted

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.submitted if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1), vLLM's definition; None with fewer than two tokens."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def inter_chunk(self) -> list[float]:
        """ITL: the gaps between text chunks (one per token when the server streams token by token)."""
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]


async def stream_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], prompt_len: int, clock: Clock
) -> ServedRequest:
    import httpx

    state = _StreamState(prompt_len)
    submitted = clock()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                detail = _error_detail((await response.aread()).decode("utf-8", "replace"))
                state.error = f"HTTP {response.status_code}: {detail}"
            else:
                async for line in response.aiter_lines():
                    if state.take(line, clock):
                        break
    except httpx.HTTPError as exc:
        state.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return state.result(submitted, clock())


class _StreamState:
    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.chunk_times: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.error: str | None = None

    def take(self, line: str, clock: Clock) -> bool:
        """Read one line of the event stream; True when the stream is over (done or failed)."""
        if not line.startswith("data:"):
            return False
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self.done = True
            return True
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"a stream event is not JSON: {data[:80]!r}"
            return True
        if not isinstance(event, dict):
            self.error = f"a stream event is not an object: {data[:80]!r}"
            return True
        if event.get("error"):
            self.error = f"error event: {_error_detail(json.dumps(event))}"
            return True
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            if _choice_text(choice):
                self.chunk_times.append(clock())
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return False

    def result(self, submitted: float, finished: float) -> ServedRequest:
        error = self.error
        if error is None and not self.done:
            error = "the stream ended before data: [DONE]"
        if error is None and self.finish_reason in FAILED_REASONS:
            error = f"finish_reason {self.finish_reason!r}"
        usage = self.usage or {}
        tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        return ServedRequest(
            prompt_len=int(usage.get("prompt_tokens") or self.prompt_len),
            submitted=submitted,
            chunk_times=tuple(self.chunk_times),
            finished=finished,
            output_tokens=int(tokens) if tokens is not None else len(self.chunk_times),
            usage_reported=tokens is not None,
            cached_tokens=int(details.get("cached_tokens") or 0),
            finish_reason=self.finish_reason,
            error=error,
        )


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:  # /v1/completions
        return choice.get("text") or ""
    delta = choice.get("delta") or {}  # /v1/chat/completions; reasoning models stream their thinking separately
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _error_detail(text: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}} or {"detail": ...}), else the text."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return " ".join(text.split())[:200] or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error)[:200]
    return str(body)[:200]
