"""`EngineClient`: the engine's caller-side surface (`generate`, `generate_samples`, `abort`, `stats`, `encode`,
`close`, `tokenizer`, `max_len`, ...) with the engine itself in a child process.

Why a process: the engine thread and a server's request handlers (HTTP parsing, JSON, SSE) share one interpreter
lock when they share a process; under load the handlers' Python work delays the engine's steps. In a process of
its own the engine steps undisturbed, and the server pays one pipe message per batch of deltas.

Why a pipe (multiprocessing.connection) rather than zmq or shared memory: one client and one engine on one host,
with a message per engine step, not per token; a pipe needs no dependency and its end closing is how each side
learns that the other has gone (the engine stops when its client dies, the client's streams end with "error" when
the engine dies).

Requests are encoded and checked here (`request_intake`), so a bad request is refused in the caller's thread with the
engine's own message, before it crosses; deltas come back batched and go to the same `RequestStream`s callers know.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import fields
from pathlib import Path
from typing import Any

from lmd.errors import LmdError
from lmd.turbomind.config import EngineConfig
from lmd.turbomind.engine import EngineStats
from lmd.turbomind.engine_core.core import run_engine_core
from lmd.turbomind.engine_core.messages import (
    Abort,
    Closed,
    Deltas,
    Ready,
    Refused,
    Shutdown,
    StartFailed,
    StatsQuery,
    StatsReply,
    Submit,
)
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.guided import GrammarCompiler
from lmd.turbomind.request_intake import Prompt, checked_request, encode_prompt
from lmd.turbomind.request_stream import Delta, RequestStream
from lmd.turbomind.speculative.config import SpeculativeConfig
from lmd.turbomind.workspace import Workspace, open_workspace

STATS_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 60.0


class EngineProcessError(RuntimeError):
    """The engine process failed a step (its repr) or exited; set as `last_error`."""


class EngineClient:
    def __init__(self, workspace: str | Path | Workspace, speculative: SpeculativeConfig | None = None,
                 **overrides: Any) -> None:
        ws = workspace if isinstance(workspace, Workspace) else open_workspace(workspace, **overrides)
        self.speculative = speculative
        self.workspace = ws
        self.tokenizer = ws.load_tokenizer()
        self.chat_template = ws.chat_template()
        config = {f.name: getattr(ws.engine, f.name) for f in fields(EngineConfig)}  # the child's is identical
        context = mp.get_context("spawn")  # a forked child would inherit CUDA state and this process's threads
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=run_engine_core, args=(child_conn, str(ws.root), config, speculative),
                                        name="lmd-engine-core")
        self._process.start()
        child_conn.close()
        # at interpreter exit without close(): our end closes, the engine sees EOF and exits (multiprocessing
        # joins non-daemon children at exit, which would otherwise wait forever)
        self._finalizer = weakref.finalize(self, _stop, self._conn, self._process)
        ready = self._wait_ready()
        self.pid, self.max_len, self.eos_ids, self.runner = ready.pid, ready.max_len, ready.eos_ids, ready.runner
        self.grammar_compiler = GrammarCompiler(self.tokenizer, ws.model.vocab_size, self.eos_ids)
        self.last_error: Exception | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._streams: dict[object, RequestStream] = {}
        self._ids = itertools.count()
        self._tickets = itertools.count()
        self._stats: dict[int, Future[EngineStats]] = {}
        self._closing = False
        self._gone = False  # the pipe is closed (engine exited or closed)
        self._reader = threading.Thread(target=self._read, name="lmd-engine-client", daemon=True)
        self._reader.start()

    # ---- the Engine surface ----

    def generate(self, prompt: Prompt, gen_config: GenerationConfig | None = None, request_id: object = None,
                 apply_chat_template: bool = True) -> RequestStream:
        config = gen_config or GenerationConfig()
        if config.num_samples > 1:
            raise LmdError(f"GenerationConfig.n={config.n}, best_of={config.best_of}: several samples come back as "
                           "several streams; call generate_samples")
        return self._submit(prompt, config, request_id, apply_chat_template, samples=False)[0]

    def generate_samples(self, prompt: Prompt, gen_config: GenerationConfig, request_id: object = None,
                         apply_chat_template: bool = True) -> list[RequestStream]:
        """As `Engine.generate_samples`: one stream per sample, ids (request_id, i)."""
        return self._submit(prompt, gen_config, request_id, apply_chat_template, samples=True)

    def abort(self, request_id: object) -> None:
        self._send(Abort(request_id), quiet=True)

    def encode(self, prompt: Prompt, apply_chat_template: bool = True) -> list[int]:
        return encode_prompt(prompt, self.tokenizer, self.chat_template, apply_chat_template)

    def stats(self) -> EngineStats:
        """A round trip to the engine process (async callers: run it in a thread, e.g. asyncio.to_thread)."""
        ticket = next(self._tickets)
        future: Future[EngineStats] = Future()
        with self._lock:
            if self._gone:
                raise LmdError("the engine process has exited; create a new engine")
            self._stats[ticket] = future
        try:
            self._send(StatsQuery(ticket))
            return future.result(timeout=STATS_TIMEOUT_S)
        except FutureTimeout:
            raise LmdError(f"the engine process did not answer a stats query within {STATS_TIMEOUT_S:g} s") from None
        finally:
            with self._lock:
                self._stats.pop(ticket, None)

    def close(self) -> None:
        """Requests still running end with "abort"; the engine process exits."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._send(Shutdown(), quiet=True)
        self._reader.join(CLOSE_TIMEOUT_S)
        self._finalizer()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----

    def _submit(self, prompt: Prompt, config: GenerationConfig, request_id: object, apply_chat_template: bool,
                samples: bool) -> list[RequestStream]:
        token_ids = self.encode(prompt, apply_chat_template)
        config = checked_request(config, token_ids, vocab_size=self.workspace.model.vocab_size,
                                 max_batch_size=self.workspace.engine.max_batch_size, max_len=self.max_len,
                                 speculative=self.speculative)
        if config.guided is not None:
            self.grammar_compiler.compile(config.guided)  # an invalid grammar is refused here, as by the engine
        with self._lock:
            if self._closing or self._gone:
                raise LmdError("the engine is closed; create a new one")
            base = next(self._ids) if request_id is None else request_id
            ids = [base] if config.num_samples == 1 else [(base, i) for i in range(config.num_samples)]
            taken = next((i for i in ids if i in self._streams), None)
            if taken is not None:
                raise LmdError(f"request_id {taken!r} is already running; use a new id")
            streams = [RequestStream(i, self.abort) for i in ids]
            self._streams.update(zip(ids, streams, strict=True))
        try:
            self._send(Submit(base, tuple(token_ids), config, samples))
        except BaseException:  # e.g. a request id that cannot be pickled: the ids are free again
            with self._lock:
                for i in ids:
                    self._streams.pop(i, None)
            raise
        return streams

    def _send(self, message: object, quiet: bool = False) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):  # ValueError: our end was closed
            if not quiet:
                raise LmdError("the engine process has exited; create a new engine (restart the server)") from None

    def _wait_ready(self) -> Ready:
        try:
            while not self._conn.poll(0.5):
                if not self._process.is_alive():
                    break
            message = self._conn.recv()
        except (EOFError, OSError):  # the child died before saying Ready or StartFailed
            self._process.join(1.0)
            self._finalizer()
            raise LmdError(f"the engine process exited with code {self._process.exitcode} while starting; see its "
                           "messages above") from None
        except BaseException:  # Ctrl+C during a long load: the child ignores SIGINT and is not reading the pipe
            self._process.terminate()
            self._finalizer()
            raise
        if isinstance(message, StartFailed):
            self._finalizer()
            raise LmdError(message.message if message.lmd_error else f"the engine failed to start: {message.message}")
        assert isinstance(message, Ready), message
        return message

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, Deltas):
                    self._deliver(message)
                elif isinstance(message, StatsReply):
                    with self._lock:
                        future = self._stats.pop(message.ticket, None)
                    if future is not None:
                        future.set_result(message.stats)
                elif isinstance(message, Refused):
                    self._refused(message)
                elif isinstance(message, Closed):
                    break
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 (our end closed under recv at interpreter exit, or a bad message)
            pass
        self._end_everything()

    def _deliver(self, message: Deltas) -> None:
        if message.error is not None:  # first: a reader may look at it as soon as its "error" delta lands
            self.last_error = EngineProcessError(message.error)
        for delta in message.deltas:
            if delta.finish_reason is None:
                stream = self._streams.get(delta.request_id)
            else:
                with self._lock:
                    stream = self._streams.pop(delta.request_id, None)
            if stream is not None:
                stream.put(delta)

    def _refused(self, message: Refused) -> None:
        self.last_error = EngineProcessError(message.message)
        ids = [message.request_id] if message.samples == 1 else [(message.request_id, i)
                                                                 for i in range(message.samples)]
        for request_id in ids:
            with self._lock:
                stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(Delta(request_id, "", (), finish_reason="error"))

    def _end_everything(self) -> None:
        """The pipe closed: after Closed every stream has ended; an engine that died leaves streams open, which end
        with "error", and pending stats queries fail."""
        with self._lock:
            self._gone = True
            streams, self._streams = self._streams, {}
            waiting, self._stats = self._stats, {}
            closing = self._closing
        if streams and not closing:
            self._process.join(1.0)
            self.last_error = EngineProcessError(f"the engine process exited (code {self._process.exitcode}) "
                                                 "while requests were running")
        for request_id, stream in streams.items():
            stream.put(Delta(request_id, "", (), finish_reason="abort" if closing else "error"))
        for future in waiting.values():
            future.set_exception(LmdError("the engine process has exited; create a new engine"))


def _stop(conn: Any, process: Any) -> None:
    """Close our end (the engine sees EOF and shuts down), then wait for the process; kill it if it hangs."""
    conn.close()
    process.join(CLOSE_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()


