"""Ranks started by torchrun: the driver's handle on them (`TorchrunWorkers`, the counterpart of the spawned
`TPWorkers`); the loop every other rank runs is `torchrun_worker.py`.

Each step's plain-data batch is broadcast from rank 0 over a gloo group (`Joined.control`), so it crosses nodes the
way the activations do. Every worker bumps a heartbeat counter in the launcher's store once a second from a thread;
when a step fails (gloo notices a closed connection at once; NCCL would wait for its timeout, the broadcast before
it does not), the driver watches the counters for a few seconds and names the ranks, with their hosts, whose
heartbeat stopped. A failed step stops the group: the other workers' next broadcast fails and they exit.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lmd.errors import LmdError
from lmd.turbomind.torchrun_env import Joined, TorchrunEnv, host_of

HEARTBEAT_S = 1.0
_STALE_CHECKS = 3  # heartbeat periods a dead rank's counter stays still before it is named


def broadcast(message: Any, group: Any) -> Any:
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class TorchrunWorkers:
    def __init__(self, env: TorchrunEnv, joined: Joined) -> None:
        self.env, self.joined = env, joined
        self._broken: LmdError | None = None

    def send(self, message: Any) -> None:
        """The step's batch to every rank; a rank gone makes this fail at once (gloo sees the closed connection)."""
        if self._broken is not None:
            raise self._broken
        with self.guard():
            broadcast(message, self.joined.control)

    @contextmanager
    def guard(self) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            self._broken = self._failure(exc)
            self.close(graceful=False)
            raise self._broken from exc

    def _failure(self, exc: BaseException) -> LmdError:
        store = self.joined.store
        ranks = range(1, self.env.world)
        seen = {r: self._beats(store, r) for r in ranks}
        for _ in range(_STALE_CHECKS):
            time.sleep(HEARTBEAT_S)
            now = {r: self._beats(store, r) for r in ranks}
            moving = {r for r in ranks if now[r] != seen[r]}
            seen = now
        stopped = [r for r in ranks if r not in moving]
        if not stopped:
            return LmdError(f"a model-parallel step failed ({exc}); close this engine and open a new one")
        named = ", ".join(f"rank {r} (node {r // self.env.local_world}, {host_of(store, r)})" for r in stopped)
        return LmdError(f"model-parallel {named} stopped; the other ranks exit; restart every torchrun")

    @staticmethod
    def _beats(store: Any, rank: int) -> int:
        try:
            return int(store.add(f"beat/{rank}", 0))
        except Exception:
            return -1

    def close(self, graceful: bool = True) -> None:
        """Ask the workers to exit (graceful), or drop the group so that they find it gone."""
        import torch.distributed as dist

        if graceful and self._broken is None:
            with contextlib.suppress(Exception):
                broadcast(None, self.joined.control)
        self._broken = self._broken or LmdError("the engine is closed; create a new one")
        if not graceful and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
