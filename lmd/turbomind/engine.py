"""The serving engine: requests in, streams of deltas out, one background thread stepping the batch.

    generate() / abort()  ->  inbox  ->  step():  schedule -> run model -> sample -> post-process -> streams

Only the engine thread touches the scheduler, block manager and cache; callers talk to it through the inbox.
With `start=False` no thread runs and the caller drives `step()` itself (tests, offline scoring).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmd.errors import LmdError
from lmd.turbomind.block_manager import BlockManager
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.model_runner import ModelRunner
from lmd.turbomind.request_state import RequestState
from lmd.turbomind.request_stream import RequestStream
from lmd.turbomind.sampler import Sampler
from lmd.turbomind.scheduler import Scheduler, SchedulerOutput
from lmd.turbomind.sequence import Sequence
from lmd.turbomind.workspace import Workspace, open_workspace

Prompt = str | list[dict[str, str]] | list[int]


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int  # free blocks still holding a reusable prefix
    prompt_tokens: int  # submitted
    computed_tokens: int  # tokens the model actually ran (prefill chunks + decodes)
    prefix_hit_tokens: int  # prompt tokens whose KV came from the prefix cache
    generated_tokens: int
    preemptions: int
    steps: int


class Engine:
    def __init__(self, workspace: str | Path | Workspace, start: bool = True, **overrides: Any) -> None:
        ws = workspace if isinstance(workspace, Workspace) else open_workspace(workspace, **overrides)
        self.workspace = ws
        self.tokenizer = ws.load_tokenizer()
        self.chat_template = ws.chat_template()
        self.runner = ModelRunner(ws)
        cfg = ws.engine
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.cache_block_seq_len)
        self.scheduler = Scheduler(self.block_manager, cfg.max_batch_size, cfg.max_context_token_num, cfg.step_length)
        self.sampler = Sampler()
        self.eos_ids = tuple(dict.fromkeys(ws.model.end_ids + self._template_stop_ids()))
        self.max_len = min(cfg.session_len, self.runner.num_blocks * cfg.cache_block_seq_len)
        self._states: dict[int, RequestState] = {}
        self._seq_of: dict[object, int] = {}
        self._next_seq_id = 0
        self._inbox: list[Callable[[], None]] = []
        self._cv = threading.Condition()
        self._counts = dict(prompt_tokens=0, computed_tokens=0, generated_tokens=0, preemptions=0, steps=0)
        self._stopping = False
        self._defer_output = start if cfg.async_output is None else cfg.async_output
        self._pending: list[tuple[RequestState, int, Any, Any, str | None]] = []  # accepted, text not yet streamed
        self.last_error: Exception | None = None
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="lmd-engine", daemon=True)
            self._thread.start()

    # ---- caller side (any thread) ----

    def generate(self, prompt: Prompt, gen_config: GenerationConfig | None = None, request_id: object = None,
                 apply_chat_template: bool = True) -> RequestStream:
        """Queue a request; iterate the returned stream (`for` or `async for`) for its deltas."""
        config = gen_config or GenerationConfig()
        config.check_vocab(self.workspace.model.vocab_size)
        token_ids = self.encode(prompt, apply_chat_template)
        if not token_ids:
            raise LmdError("the prompt is empty; give text, messages or at least one token id")
        if len(token_ids) >= self.max_len:
            raise LmdError(f"the prompt has {len(token_ids)} tokens; this engine holds at most {self.max_len} "
                           "per session (session_len / KV cache); shorten it or raise session_len")
        with self._cv:
            if self._stopping:
                raise LmdError("the engine is closed; create a new one")
            seq = Sequence(self._next_seq_id, token_ids)
            self._next_seq_id += 1
            request_id = seq.seq_id if request_id is None else request_id
            if request_id in self._seq_of:
                raise LmdError(f"request_id {request_id!r} is already running; use a new id")
            stream = RequestStream(request_id, self.abort)
            state = RequestState(request_id, seq, config, self.tokenizer, self.eos_ids, self.max_len, stream)
            self._seq_of[request_id] = seq.seq_id
            self._inbox.append(lambda: self._admit(state))
            self._cv.notify()
        return stream

    def abort(self, request_id: object) -> None:
        """Stop a request and free its KV blocks at the next step; its stream ends with finish_reason 'abort'."""
        with self._cv:
            self._inbox.append(lambda: self._abort(request_id))
            self._cv.notify()

    def encode(self, prompt: Prompt, apply_chat_template: bool = True) -> list[int]:
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str) and not apply_chat_template:
            return list(self.tokenizer(prompt)["input_ids"])
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.chat_template.encode(messages, self.tokenizer)  # type: ignore[arg-type]

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), bm.num_blocks, bm.num_used,
                           bm.num_free, bm.num_cached_free, prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
                           **self._counts)

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
        self._drain_inbox()  # requests queued but never admitted end with "abort" too
        self._end_all("abort")
        self.runner.close()  # tensor parallelism: the worker processes exit

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- engine thread ----

    def step(self) -> bool:
        """One batch step; False when there was nothing to compute.

        Deferred output (`async_output`, with the engine thread): a step's sampled ids are accepted at once (the next
        schedule needs them; stop tokens and lengths end requests here), their text deltas are made and streamed
        while the GPU runs the next step. A stop string is therefore seen one step late: the request's token of
        that next step is computed and dropped, and its stream is exactly what it would have been."""
        self._drain_inbox()
        output = self.scheduler.schedule()
        if not output.chunks:
            self._emit_pending()
            return False
        logits = self.runner.run(output)  # on CUDA the launch returns at once; sampling below waits for the GPU
        self.scheduler.complete_step(output)
        states = [self._states[c.seq_id] for c in output.chunks if c.needs_logits]
        rows = [state.sampling_row() for state in states]
        if self._defer_output:
            self._emit_pending()
        samples = self.sampler.sample(logits, rows)
        self._accept(output, states, samples.token_ids, samples.logprobs, samples.top_logprobs)
        if not self._defer_output:
            self._emit_pending()
        return True

    def _accept(self, output: SchedulerOutput, states: list[RequestState], tokens: list[int], logprobs: list,
                top: list) -> None:
        self._counts["steps"] += 1
        self._counts["computed_tokens"] += output.num_tokens
        self._counts["preemptions"] += len(output.preempted)
        for state, token, logprob, alternatives in zip(states, tokens, logprobs, top, strict=True):
            if state.finished:  # ended by a stop string while this step ran: its token is dropped
                continue
            finish = state.accept(token)
            self._counts["generated_tokens"] += 1
            if finish is not None:  # free at once; the final delta follows with the text
                self._finish(state.seq.seq_id, None)
            self._pending.append((state, token, logprob, alternatives, finish))

    def _emit_pending(self) -> None:
        """Text deltas of the accepted tokens, in order, to their streams."""
        pending, self._pending = self._pending, []
        for state, token, logprob, alternatives, finish in pending:
            delta = state.delta(token, logprob, alternatives, finish)
            if delta.finish_reason is not None and not state.finished:  # a stop string: free first, as below
                self._finish(state.seq.seq_id, None)
            state.stream.put(delta)

    def _admit(self, state: RequestState) -> None:
        self._states[state.seq.seq_id] = state
        self._counts["prompt_tokens"] += len(state.seq)
        self.scheduler.add(state.seq)

    def _abort(self, request_id: object) -> None:
        self._emit_pending()  # the request's earlier deltas reach its stream before the abort
        seq_id = self._seq_of.get(request_id)
        if seq_id is not None and seq_id in self._states:
            self._finish(seq_id, "abort")

    def _finish(self, seq_id: int, reason: str | None) -> None:
        """Free everything of a request; `reason` set: also end its stream (abort, error)."""
        state = self._states.pop(seq_id)
        state.finished = True
        with self._cv:  # generate() checks request ids under the same lock
            self._seq_of.pop(state.request_id, None)
        self.scheduler.finish(state.seq)
        if reason is not None:
            state.stream.put(state.final_delta(reason, state.stop_strings.flush()))

    def _end_all(self, reason: str) -> None:
        self._emit_pending()
        for seq_id in list(self._states):
            self._finish(seq_id, reason)

    def _drain_inbox(self) -> None:
        with self._cv:
            commands, self._inbox = self._inbox, []
        for command in commands:
            command()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._inbox or self.scheduler.has_work()):
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                progressed = self.step()
            except Exception as exc:  # a failed step ends every request in flight, the engine stays usable
                self.last_error = exc  # first: a reader may look at it as soon as its "error" delta lands
                with contextlib.suppress(Exception):  # the deltas of tokens accepted before the failure
                    self._emit_pending()
                self._end_all("error")
                continue
            if not self.scheduler.has_work():  # idle next: the last step's deltas go out now
                self._emit_pending()
            if not progressed:
                with self._cv:
                    self._cv.wait(timeout=0.005)

    def _template_stop_ids(self) -> tuple[int, ...]:
        """Stop words of the chat template that are single tokens (e.g. <|im_end|>) end a turn like eos."""
        ids = []
        for word in self.chat_template.stop_words:
            encoded = self.tokenizer.convert_tokens_to_ids(word)
            if isinstance(encoded, int) and encoded != self.tokenizer.unk_token_id:
                ids.append(encoded)
        return tuple(ids)
