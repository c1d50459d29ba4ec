"""The engine-core process: an `Engine` stepping on its own thread, fed by the client's messages, its deltas shipped
back in batches. Nothing else runs in this process, so the engine thread shares the interpreter lock only with two
light threads (this reader and the shipper), never with the server's HTTP, JSON and SSE work."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

from lmd.errors import LmdError
from lmd.turbomind.engine import Engine
from lmd.turbomind.engine_core.messages import (
    Abort,
    Closed,
    Deltas,
    GraphsInfo,
    Ready,
    Refused,
    RunnerInfo,
    Shutdown,
    StartFailed,
    StatsQuery,
    StatsReply,
    Submit,
)
from lmd.turbomind.request_stream import Delta
from lmd.turbomind.speculative.config import SpeculativeConfig

_log = logging.getLogger("lmd.engine")


class _Outbox:
    """Deltas from the engine thread, shipped as one `Deltas` message per batch by a thread of its own, so the
    engine thread only appends to a list (pickling and the pipe write happen while it waits for the GPU)."""

    def __init__(self, conn: Connection, engine: Engine) -> None:
        self._conn, self._engine = conn, engine
        self._send_lock = threading.Lock()
        self._cv = threading.Condition()
        self._deltas: list[Delta] = []
        self._closing = False
        self._thread = threading.Thread(target=self._ship, name="lmd-engine-outbox", daemon=True)
        self._thread.start()

    def put(self, delta: Delta) -> None:
        with self._cv:
            self._deltas.append(delta)
            if len(self._deltas) == 1:
                self._cv.notify()

    def send(self, message: object) -> None:
        with self._send_lock:
            self._conn.send(message)

    def close(self) -> None:
        """Ship what is left, then `Closed`."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()
        self.send(Closed())

    def _ship(self) -> None:
        while True:
            with self._cv:
                while not (self._deltas or self._closing):
                    self._cv.wait()
                batch, self._deltas = self._deltas, []
            if not batch:
                return  # closing, nothing left
            error = self._engine.last_error
            failed = error is not None and any(d.finish_reason == "error" for d in batch)
            try:
                self.send(Deltas(tuple(batch), repr(error) if failed else None))
            except OSError:  # the client is gone; the reader sees EOF and shuts the engine down
                return


def run_engine_core(conn: Connection, workspace: str, overrides: dict[str, Any],
                    speculative: SpeculativeConfig | None = None) -> None:
    """The child process's entry point: build the engine, say Ready (or StartFailed), then serve messages until
    Shutdown or the client's end of the pipe closes (the client process exited: the engine stops too). Ctrl+C
    reaches the whole process group; the client decides when this process stops, so SIGINT is ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = Engine(workspace, speculative=speculative, **overrides)
    except BaseException as exc:  # one message for the client, which raises it as a one-line error
        if not isinstance(exc, LmdError):
            _log.exception("the engine failed to start")
        conn.send(StartFailed(str(exc) if isinstance(exc, LmdError) else repr(exc), isinstance(exc, LmdError)))
        conn.close()
        return
    outbox = _Outbox(conn, engine)
    runner = engine.runner
    graphs = None if runner.graphs is None else GraphsInfo(runner.graphs.capture, tuple(runner.graphs.buckets))
    outbox.send(Ready(os.getpid(), engine.max_len, engine.eos_ids,
                      RunnerInfo(str(runner.device), graphs)))
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, Shutdown):
                break
            try:
                _handle(engine, outbox, message)
            except Exception as exc:  # a bug in one request's handling must not stop the engine for every other
                _log.exception("engine core: handling %s failed", type(message).__name__)
                if isinstance(message, Submit):
                    samples = message.config.num_samples if message.samples else 1
                    outbox.send(Refused(message.request_id, samples, repr(exc)))
    finally:
        engine.close()  # requests still running end with "abort"; their last deltas go out before Closed
        with contextlib.suppress(OSError):
            outbox.close()
        conn.close()


def _handle(engine: Engine, outbox: _Outbox, message: object) -> None:
    if isinstance(message, Submit):
        try:
            if message.samples:
                streams = engine.generate_samples(list(message.token_ids), message.config, message.request_id,
                                                  apply_chat_template=False)
            else:
                streams = [engine.generate(list(message.token_ids), message.config, message.request_id,
                                           apply_chat_template=False)]
        except LmdError as exc:
            outbox.send(Refused(message.request_id, message.config.num_samples if message.samples else 1, str(exc)))
            return
        for stream in streams:
            stream.forward(outbox.put)
    elif isinstance(message, Abort):
        engine.abort(message.request_id)
    elif isinstance(message, StatsQuery):
        outbox.send(StatsReply(message.ticket, engine.stats()))
    else:
        _log.error("engine core: unknown message %r ignored", type(message).__name__)
