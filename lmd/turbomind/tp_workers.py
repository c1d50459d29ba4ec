"""The driver's side of tensor parallelism: spawning the worker processes, feeding them batches, noticing a crash.

A dead worker never leaves the driver waiting: each send first checks that every worker is alive, and a collective
that fails (gloo sees the closed connection of a killed peer) becomes one LmdError naming the worker and its error.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from lmd.errors import LmdError
from lmd.turbomind.tp_worker import READY, WorkerRunner, worker_main
from lmd.turbomind.workspace import Workspace

JOIN_TIMEOUT_S = 10.0


class TPWorkers:
    def __init__(self, ws: Workspace, port: int, make_runner: Callable[..., WorkerRunner]) -> None:
        ctx = mp.get_context("spawn")
        options = dataclasses.asdict(ws.engine)
        self._broken: LmdError | None = None
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        self._tp = ws.engine.tp
        for rank in range(1, ws.engine.tp * ws.engine.pp):  # global ranks: stage rank // tp, tp rank rank % tp
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(rank, ws.engine.tp, port, str(ws.root), options, child, make_runner),
                name=f"lmd-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        for conn in self._conns:  # a worker that cannot even start fails here, not in a rendezvous that waits
            while not conn.poll(0.05):
                self.check_alive()
            if conn.recv() != READY:
                raise self._failure(None)

    def send(self, message: Any) -> None:
        """The step's batch (chunks, logit rows, whether the driver replays its decode graph) to every worker."""
        if self._broken is not None:
            raise self._broken
        self.check_alive()
        try:
            for conn in self._conns:
                conn.send(message)
        except OSError as exc:
            raise self._failure(exc) from exc

    def check_alive(self) -> None:
        if any(not proc.is_alive() for proc in self._procs):
            raise self._failure(None)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a failed step into an LmdError naming the worker that died. Any failure mid-forward leaves the ranks
        at different collectives, so the workers are stopped and every later step raises the same error."""
        try:
            yield
        except Exception as exc:
            for proc in self._procs:  # a worker that failed is exiting: give it a moment to say why
                proc.join(timeout=1.0)
            self._broken = self._failure(exc)
            self.close(graceful=False)
            raise self._broken from exc

    def _failure(self, exc: BaseException | None) -> LmdError:
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True), start=1):
            if proc.is_alive():
                continue
            reason = f"exit code {proc.exitcode}"
            try:
                if conn.poll():
                    reason = conn.recv()
            except (OSError, EOFError):
                pass
            where = f"stage {rank // self._tp}, tp rank {rank % self._tp}"
            return LmdError(f"model-parallel worker rank {rank} ({where}) died ({reason}); close this engine and "
                            "open a new one")
        return LmdError(f"a model-parallel step failed ({exc}); close this engine and open a new one")

    def close(self, graceful: bool = True) -> None:
        """Ask the workers to exit; one still there after JOIN_TIMEOUT_S (or at once: not graceful) is terminated."""
        for conn in self._conns:
            with suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            if graceful:
                proc.join(timeout=JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=JOIN_TIMEOUT_S)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
