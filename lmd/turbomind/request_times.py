"""When a request was queued, first scheduled, gave its first token and finished: wall-clock seconds (time.time(),
comparable across the processes of one host), carried by a request's final delta for tracing and latency reports."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestTimes:
    queued: float
    scheduled: float | None  # None: ended (abort, error) before any step computed it
    first_token: float | None  # None: ended before its first token
    finished: float


class RequestTimer:
    """The engine's running record of one request (mutable; frozen into RequestTimes by `finish`)."""

    __slots__ = ("queued", "scheduled", "first_token")

    def __init__(self) -> None:
        self.queued = time.time()
        self.scheduled: float | None = None
        self.first_token: float | None = None

    def finish(self, has_token: bool) -> RequestTimes:
        now = time.time()
        if has_token and self.first_token is None:
            self.first_token = now
        return RequestTimes(self.queued, self.scheduled, self.first_token, now)
