"""Everything that crosses the pipe between `EngineClient` (the caller's process) and the engine-core process.

Client -> core: Submit, Abort, StatsQuery, Shutdown. Core -> client: Ready or StartFailed (once, first), then
Deltas (one message per batch of deltas the engine emitted, in emission order), StatsReply, Refused, Closed.
Every message is a frozen dataclass pickled by multiprocessing.connection.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmd.turbomind.engine import EngineStats
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.request_stream import Delta


@dataclass(frozen=True)
class Submit:
    request_id: object  # samples > 1: the engine's ids are (request_id, i)
    token_ids: tuple[int, ...]
    config: GenerationConfig  # already checked (checked_request) by the client
    samples: bool  # Engine.generate_samples rather than Engine.generate


@dataclass(frozen=True)
class Abort:
    request_id: object


@dataclass(frozen=True)
class StatsQuery:
    ticket: int


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class GraphsInfo:
    capture: bool
    buckets: tuple[int, ...]


@dataclass(frozen=True)
class RunnerInfo:
    """What callers read of the engine's model runner (`lmd serve`'s start-up table: `.device`, `.graphs`)."""

    device: str
    graphs: GraphsInfo | None


@dataclass(frozen=True)
class Ready:
    pid: int
    max_len: int
    eos_ids: tuple[int, ...]
    runner: RunnerInfo


@dataclass(frozen=True)
class StartFailed:
    message: str
    lmd_error: bool  # an LmdError (bad input, one line for the user) rather than a bug


@dataclass(frozen=True)
class Deltas:
    deltas: tuple[Delta, ...]
    error: str | None  # repr of the engine's last_error when a delta of this batch ends with "error"


@dataclass(frozen=True)
class StatsReply:
    ticket: int
    stats: EngineStats


@dataclass(frozen=True)
class Refused:
    """The engine refused a Submit the client had checked (a race, e.g. the engine closing): its streams end."""

    request_id: object
    samples: int
    message: str


@dataclass(frozen=True)
class Closed:
    pass
