"""One request's timeline: when it was submitted, when each generated token arrived, how it ended.

Times come from the caller's clock (time.perf_counter by default; tests pass a fake one). A stream is read with
`async for`, so deltas of every request in flight are stamped as they arrive, not when a reader gets round to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmd.bench.sampling import BenchRequest
from lmd.turbomind.gen_config import GenerationConfig

if TYPE_CHECKING:
    from lmd.turbomind.engine import Engine
    from lmd.turbomind.request_stream import RequestStream

Clock = Callable[[], float]


@dataclass(frozen=True)
class Timeline:
    prompt_len: int
    submitted: float
    token_times: tuple[float, ...]  # arrival of each generated token, in order (one entry per token id)
    finished: float
    finish_reason: str
    completion_tokens: int  # the engine's own count (usage), for cross-checking len(token_times)
    cached_tokens: int  # prompt tokens served from the prefix cache

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def latency(self) -> float:
        return self.finished - self.submitted

    @property
    def ttft(self) -> float | None:
        """Time to first token; None when no token came back (an abort or error before the first one)."""
        return self.token_times[0] - self.submitted if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: the mean decode interval; None with fewer than two tokens."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def inter_token(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]


def generation_config(request: BenchRequest, temperature: float = 0.0, seed: int | None = None) -> GenerationConfig:
    """Greedy by default; temperature > 0 samples from the whole vocabulary (top-k and top-p off)."""
    return GenerationConfig(
        max_new_tokens=request.output_len,
        ignore_eos=request.exact,
        temperature=temperature,
        top_k=1 if temperature == 0 else 0,
        top_p=1.0,
        seed=seed,
    )


async def read_timeline(stream: RequestStream, request: BenchRequest, submitted: float, clock: Clock) -> Timeline:
    times: list[float] = []
    reason, completion, cached = "abort", 0, 0
    async for delta in stream:
        now = clock()
        times.extend([now] * len(delta.token_ids))
        if delta.finish_reason is not None:
            reason = delta.finish_reason
            if delta.usage is not None:
                completion, cached = delta.usage.completion_tokens, delta.usage.cached_tokens
    return Timeline(request.prompt_len, submitted, tuple(times), clock(), reason, completion, cached)


async def run_request(engine: Engine, request: BenchRequest, config: GenerationConfig, clock: Clock) -> Timeline:
    submitted = clock()
    stream = engine.generate(list(request.prompt_ids), config)
    return await read_timeline(stream, request, submitted, clock)
