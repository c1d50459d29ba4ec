"""The serving engine: requests in, streams of deltas out, one background thread stepping the batch.

    generate() / abort()  ->  inbox  ->  step():  schedule -> run model -> sample -> post-process -> streams

Only the engine thread touches the scheduler, block manager and cache; callers talk to it through the inbox.
With `start=False` no thread runs and the caller drives `step()` itself (tests, offline scoring).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmd.errors import LmdError
from lmd.turbomind.beam_request import BeamRequest
from lmd.turbomind.beam_searches import BeamSearches
from lmd.turbomind.block_manager import BlockManager
from lmd.turbomind.forward_batch import InflightIds
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.guided import GrammarCompiler
from lmd.turbomind.kernels.host_copy import to_device
from lmd.turbomind.model_runner import ModelRunner
from lmd.turbomind.prompt_logprobs import PendingPromptLogprobs, plan
from lmd.turbomind.request_intake import Prompt, checked_request, encode_prompt
from lmd.turbomind.request_state import RequestState
from lmd.turbomind.request_stream import Delta, RequestStream, put_many
from lmd.turbomind.sampler import PendingSample, Sampler
from lmd.turbomind.scheduler import Scheduler, SchedulerOutput
from lmd.turbomind.sequence import Sequence
from lmd.turbomind.speculative.config import SpeculativeConfig
from lmd.turbomind.speculative.request import SpeculativeRequest
from lmd.turbomind.speculative.speculator import COUNTERS, Speculator
from lmd.turbomind.workspace import Workspace, open_workspace


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
    prefill_steps: int = 0  # steps with a prompt chunk of more than one token (eager on CUDA; the rest replay graphs)
    speculative_method: str | None = None  # None: no speculative decoding
    spec_verifications: int = 0  # sequence-steps that verified at least one proposed token
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0  # proposals the target model confirmed

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verification makes on average: the accepted proposals plus the target's own next token."""
        return 1 + self.spec_accepted_tokens / self.spec_verifications if self.spec_verifications else 0.0


@dataclass
class _InflightStep:
    """A launched step whose sampled ids have not been resolved on the host."""

    states: list[RequestState]  # one per sampled row
    sample: PendingSample
    ids: InflightIds
    prompt: PendingPromptLogprobs | None = None
    prompt_states: dict[int, RequestState] | None = None  # owners of `prompt`'s targets
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # seq_id -> proposals verified


class Engine:
    def __init__(self, workspace: str | Path | Workspace, start: bool = True,
                 speculative: SpeculativeConfig | None = None, **overrides: Any) -> None:
        ws = workspace if isinstance(workspace, Workspace) else open_workspace(workspace, **overrides)
        if speculative is not None and ws.engine.tp * ws.engine.pp > 1:
            raise LmdError(f"speculative decoding runs on one rank only; got tp={ws.engine.tp}, pp={ws.engine.pp}")
        self.workspace = ws
        self.speculative = speculative
        self.tokenizer = ws.load_tokenizer()
        self.chat_template = ws.chat_template()
        self.runner = ModelRunner(ws)
        self.speculator = None if speculative is None else Speculator(speculative, ws, self.tokenizer,
                                                                      self.runner.num_blocks)
        if self.speculator is not None:  # verification graphs at start, as the decode graphs
            self.speculator.prepare(self.runner)
        cfg = ws.engine
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.cache_block_seq_len, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_batch_size, cfg.max_context_token_num, cfg.step_length)
        self.sampler = Sampler()
        self.eos_ids = tuple(dict.fromkeys(ws.model.end_ids + self._template_stop_ids()))
        # Structured outputs; xgrammar is imported (and the vocabulary read) by the first guided request only.
        self.grammar_compiler = GrammarCompiler(self.tokenizer, ws.model.vocab_size, self.eos_ids)
        self.max_len = min(cfg.session_len, self.runner.num_blocks * cfg.cache_block_seq_len)
        self._states: dict[int, RequestState] = {}
        self._unscheduled: dict[int, RequestState] = {}  # admitted, no step has computed them yet
        self._seq_of: dict[object, int] = {}
        self._next_seq_id = 0
        self._inbox: list[Callable[[], None]] = []
        self._cv = threading.Condition()
        self.beams = BeamSearches(self.scheduler, self.block_manager, self.runner, self.tokenizer, self._new_seq_id,
                                  self._forget_ids)
        self._counts = dict(prompt_tokens=0, computed_tokens=0, generated_tokens=0, preemptions=0, steps=0,
                            prefill_steps=0)
        self._stopping = False
        self._defer_output = start if cfg.async_output is None else cfg.async_output
        self._pending: list[tuple[RequestState, int, Any, Any, str | None]] = []  # accepted, text not yet streamed
        self._overlap = self._defer_output and self.runner.world == 1  # in-flight ids stay on rank 0's device
        self._inflight: _InflightStep | None = None
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
        if config.num_samples > 1:
            raise LmdError(f"GenerationConfig.n={config.n}, best_of={config.best_of}: several samples come back as "
                           "several streams; call Engine.generate_samples")
        return self._generate(prompt, config, request_id, apply_chat_template)[0]

    def generate_samples(self, prompt: Prompt, gen_config: GenerationConfig, request_id: object = None,
                         apply_chat_template: bool = True) -> list[RequestStream]:
        """Parallel sampling: `gen_config.num_samples` streams (n, or best_of) of one prompt, prefilled once. The
        first sample's sequence computes the prompt; when its first token is sampled the others are forked from it
        (full KV blocks shared by reference count, a partly filled last block copied) and decode on their own.
        Request ids are (request_id, i). best_of: rank the finished responses with `best_by_logprob`."""
        return self._generate(prompt, gen_config, request_id, apply_chat_template)

    def _generate(self, prompt: Prompt, config: GenerationConfig, request_id: object,
                  apply_chat_template: bool) -> list[RequestStream]:
        token_ids = self.encode(prompt, apply_chat_template)
        config = checked_request(config, token_ids, vocab_size=self.workspace.model.vocab_size,
                                 max_batch_size=self.scheduler.max_batch_size, max_len=self.max_len,
                                 speculative=self.speculative)
        samples = config.num_samples
        matcher = None if config.guided is None else self.grammar_compiler.matcher(config.guided,
                                                                                   config.stop_token_ids)
        limit = min(len(token_ids) + config.max_new_tokens, self.max_len)
        if config.beam_width > 1:
            return self._generate_beams(token_ids, config, request_id, limit)
        with self._cv:
            if self._stopping:
                raise LmdError("the engine is closed; create a new one")
            base = self._next_seq_id if request_id is None else request_id
            ids = [base] if samples == 1 else [(base, i) for i in range(samples)]
            taken = next((i for i in ids if i in self._seq_of), None)
            if taken is not None:
                raise LmdError(f"request_id {taken!r} is already running; use a new id")
            states = []
            for i, rid in enumerate(ids):
                seq = Sequence(self._next_seq_id, list(token_ids), max_num_tokens=limit,
                               prompt_logits=config.prompt_logprobs is not None and i == 0)
                self._next_seq_id += 1
                sample_matcher = matcher if i == 0 or matcher is None else matcher.fork()
                states.append(RequestState(rid, seq, config, self.tokenizer, self.eos_ids, self.max_len,
                                           RequestStream(rid, self.abort), sample_matcher, sample_index=i))
                if self.speculative is not None:
                    states[-1].speculative = SpeculativeRequest(self.speculative)
                self._seq_of[rid] = seq.seq_id
            first = states[0]
            first.siblings = states[1:]
            first.seq.num_reserved_forks = samples - 1
            for sibling in first.siblings:
                sibling.fork_parent = first.seq
                sibling.prompt_logprobs = None  # the prompt's logprobs come once, with the first sample
            self._inbox.append(lambda: self._admit(states))
            self._cv.notify()
        return [state.stream for state in states]

    def _generate_beams(self, token_ids: list[int], config: GenerationConfig, request_id: object,
                        limit: int) -> list[RequestStream]:
        """Beam search: config.n streams, each ending with one delta (the n best hypotheses, best first)."""
        width, bm = config.beam_width, self.block_manager
        if self.speculative is not None:
            raise LmdError("beam search and speculative decoding do not combine; start the engine without "
                           "speculative, or drop beam_width")
        if width * bm.blocks_for(limit) > bm.num_blocks:  # the beams alone always fit, whatever they share
            raise LmdError(f"beam search with beam_width={width} up to {limit} tokens may need "
                           f"{width * bm.blocks_for(limit)} KV blocks; the cache has {bm.num_blocks}; lower "
                           "beam_width or max_new_tokens, or give the KV cache more memory")
        end_ids = tuple(dict.fromkeys(config.stop_token_ids + (() if config.ignore_eos else self.eos_ids)))
        with self._cv:
            if self._stopping:
                raise LmdError("the engine is closed; create a new one")
            base = self._next_seq_id if request_id is None else request_id
            ids = [base] if config.n == 1 else [(base, i) for i in range(config.n)]
            taken = next((i for i in ids if i in self._seq_of), None)
            if taken is not None:
                raise LmdError(f"request_id {taken!r} is already running; use a new id")
            seq = Sequence(self._next_seq_id, list(token_ids), max_num_tokens=limit)
            self._next_seq_id += 1
            request = BeamRequest(ids, [RequestStream(rid, self.abort) for rid in ids], seq, config, end_ids,
                                  limit - len(token_ids))
            for rid in ids:
                self._seq_of[rid] = seq.seq_id
            self._inbox.append(lambda: self._admit_beams(request))
            self._cv.notify()
        return request.streams

    def abort(self, request_id: object) -> None:
        """Stop a request and free its KV blocks at the next step; its stream ends with finish_reason 'abort'."""
        with self._cv:
            self._inbox.append(lambda: self._abort(request_id))
            self._cv.notify()

    def encode(self, prompt: Prompt, apply_chat_template: bool = True) -> list[int]:
        return encode_prompt(prompt, self.tokenizer, self.chat_template, apply_chat_template)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        method = None if self.speculative is None else self.speculative.method
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), bm.num_blocks, bm.num_used,
                           bm.num_free, bm.num_cached_free, prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
                           speculative_method=method, **self._counts,
                           **(dict.fromkeys(COUNTERS, 0) if self.speculator is None else self.speculator.counts))

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
        self._drain_inbox()  # requests queued but never admitted end with "abort" too
        self._end_all("abort")
        self.runner.close()  # tensor parallelism: the worker processes exit
        if self.speculator is not None:
            self.speculator.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- engine thread ----

    def step(self) -> bool:
        """One batch step; False when there was nothing to compute.

        Overlap (`async_output`, on with the engine thread, tp = 1): the step is launched before the previous one's
        sampled ids reach the host. A sequence whose token is still being sampled is scheduled with an INFLIGHT id,
        which the runner takes from the previous step's samples on the device; then the previous step is resolved
        (ids to the host, stop tokens and lengths end requests, blocks freed), this step's sampling is queued, and
        the previous step's text deltas are made and streamed while the GPU runs. A request ended by the resolved
        step has one more token computed in this step, which is dropped (so is the token after a stop string): its
        stream is exactly what the step-by-step engine gives. The sampling rows are built after the resolve, so
        penalties and min_new_tokens see every token.
        Without overlap and with deferred output (tp > 1), only the text waits for the next step."""
        self._drain_inbox()
        proposed = [] if self.speculator is None else self.speculator.propose(self.scheduler.running, self._states,
                                                                            self.max_len, self.sampler)
        output = self.scheduler.schedule()
        if not output.chunks and self.beams and self._inflight is None:
            output = self.beams.unblock() or output
        if self._unscheduled or self.beams:
            self._stamp_scheduled(output)
        for seq in proposed:
            seq.draft_token_ids = []  # taken into this step's chunks (or dropped: preempted, out of budget)
        if not output.chunks:
            resolved = self._resolve_inflight()
            self._emit_pending()
            return resolved
        previous = self._inflight
        ids = None if previous is None else previous.ids
        logits = (self.runner.run(output, ids) if self.speculator is None  # CUDA: returns at once
                  else self.speculator.run(self.runner, output, self._states, ids))
        self.scheduler.complete_step(output)
        self._counts["steps"] += 1
        self._counts["prefill_steps"] += any(len(c.token_ids) - c.num_draft > 1 for c in output.chunks)
        self._counts["computed_tokens"] += output.num_tokens
        self._counts["preemptions"] += len(output.preempted)
        # before a resolve frees any
        step_logits = logits
        states, logits, prompt, prompt_states, drafts = self._sampled_rows(output, logits)
        self._resolve_inflight()
        if states or prompt is not None:  # a chunk of prompt logprobs alone is resolved like a sampled step
            sample = (self.sampler.launch(logits, [state.sampling_row() for state in states])
                      if self.speculator is None else self.speculator.launch(self.sampler, logits, states, drafts))
            for state in dict.fromkeys(states):
                state.seq.num_inflight += 1
            rows = {state.seq.seq_id: i for i, state in enumerate(states)}  # a verification: its last row (unused)
            self._inflight = _InflightStep(states, sample, InflightIds(rows, sample.token_ids_device), prompt,
                                           prompt_states, drafts)
        if self.beams.rows:  # waits for this step's logits: beams are never overlapped
            self._counts["generated_tokens"] += self.beams.advance(step_logits)
        # A speculating request's next proposal needs every token it has: its steps are not overlapped.
        speculating = self.speculative is not None and any(state.speculative is not None for state in states)
        if self._overlap and not speculating:
            self._emit_pending()  # the previous step's text, while the GPU runs this one
        elif self._defer_output:  # tp > 1: the previous step's text first, then this step's ids
            self._emit_pending()
            self._resolve_inflight()
        else:
            self._resolve_inflight()
            self._emit_pending()
        return True

    def _resolve_inflight(self) -> bool:
        """The in-flight step's ids on the host: accepted in order, requests they end freed, deltas queued."""
        step, self._inflight = self._inflight, None
        if step is None:
            return False
        result = step.sample.result()
        for state in step.states:  # forks first: a first sample that ends here must not free what they share
            if state.fork_parent is not None and not state.finished:
                self._fork(state)
        if step.prompt is not None:  # copied before the sample event: ready
            for seq_id, entries in step.prompt.resolve().items():
                step.prompt_states[seq_id].prompt_logprobs.extend(entries)  # type: ignore[index, union-attr]
        rows = list(zip(step.states, result.token_ids, result.logprobs, result.top_logprobs, strict=True))
        i = 0
        while i < len(rows):
            state, token, logprob, alternatives = rows[i]
            seq = state.seq
            drafts = step.drafts.get(seq.seq_id)
            i += 1 + len(drafts or ())
            seq.num_inflight -= 1
            if state.finished:  # ended (stop string, abort, the step before) while this token was computed: dropped
                continue
            if drafts:
                self.speculator.accept(state, rows[i - 1 - len(drafts):i], drafts, self.runner.cache,  # type: ignore[union-attr]
                                       self.block_manager, self._accept_now)
                continue
            finish = state.accept(token)
            self.block_manager.commit_full_blocks(seq)  # a block its id completes (its KV is in the cache)
            self._counts["generated_tokens"] += 1
            if finish is not None:  # free at once; the final delta follows with the text
                self._finish(seq.seq_id, None)
            self._pending.append((state, token, logprob, alternatives, finish))
        return True

    def _sampled_rows(self, output: SchedulerOutput, logits: torch.Tensor) -> tuple[
            list[RequestState], torch.Tensor, PendingPromptLogprobs | None, dict[int, RequestState] | None,
            dict[int, tuple[int, ...]]]:
        """The states sampled this step and their logits rows (a first sample under parallel sampling brings its
        siblings, on the same row; a verification of k proposals its state k + 1 times, one row per position), the
        prompt logprobs of the all_logits chunks (queued), and the proposals verified."""
        states, sample_rows, targets, owners, row, reshaped = [], [], [], {}, 0, False
        drafts: dict[int, tuple[int, ...]] = {}
        self.beams.rows = []  # beams' rows, for BeamSearches.advance
        for chunk in output.chunks:
            if chunk.seq_id in self.beams.of_seq:  # a beam: its row goes to the beam search, not to the sampler
                if chunk.needs_logits:
                    self.beams.rows.append((chunk.seq_id, row))
                    row += 1
                    reshaped = True
                continue
            if chunk.num_draft:
                state = self._states[chunk.seq_id]
                drafts[chunk.seq_id] = chunk.token_ids[-chunk.num_draft:]
                states.extend([state] * (1 + chunk.num_draft))
                sample_rows.extend(range(row, row + 1 + chunk.num_draft))
                row += 1 + chunk.num_draft
                continue
            width = len(chunk.token_ids) if chunk.all_logits else int(chunk.needs_logits)
            if chunk.all_logits:
                reshaped = True
                state = self._states[chunk.seq_id]
                planned = plan(chunk, row, state.seq.num_prompt_tokens, state.prompt_logprobs_planned,
                               state.config.prompt_logprobs or 0)
                if planned is not None:
                    targets.append(planned)
                    owners[chunk.seq_id] = state
                    state.prompt_logprobs_planned = planned.first + planned.count
            if chunk.needs_logits:
                state = self._states[chunk.seq_id]
                group = [state] + [s for s in state.siblings if not s.finished]
                state.siblings = []  # they fork when this step is resolved
                states.extend(group)
                sample_rows.extend([row + width - 1] * len(group))
                reshaped |= len(group) > 1
            row += width
        if not reshaped:
            return states, logits, None, None, drafts
        prompt_ids = {seq_id: state.seq.token_ids for seq_id, state in owners.items()}
        prompt = PendingPromptLogprobs(logits, targets, prompt_ids) if targets else None
        return states, logits[to_device(sample_rows, torch.int64, logits.device)], prompt, owners, drafts

    def _accept_now(self, state: RequestState, token: int, logprob: Any, alternatives: Any) -> bool:
        """One verified token through the stop checks and the text at once (a speculating request's steps are
        resolved before the next is launched, so none of its earlier tokens waits in `_pending`); True when it ended
        the request (stop or eos token, length, a stop string)."""
        finish = state.accept(token)
        self.block_manager.commit_full_blocks(state.seq)
        self._counts["generated_tokens"] += 1
        delta = state.delta(token, logprob, alternatives, finish)
        self._put(state, delta)
        if delta.finish_reason is not None:
            self._finish(state.seq.seq_id, None)
        return delta.finish_reason is not None

    def _fork(self, state: RequestState) -> None:
        """A sibling takes the prompt's KV of the sequence it forks from, or, if that sequence lost it (preempted) or
        no block is free for the copy, recomputes it (mostly prefix-cache hits: the full blocks are committed)."""
        parent, child = state.fork_parent, state.seq
        state.fork_parent = None
        prompt = child.num_prompt_tokens
        parent.num_reserved_forks = max(0, parent.num_reserved_forks - 1)  # type: ignore[union-attr]
        shared = (self.runner.world == 1 and parent.num_computed_tokens >= prompt  # type: ignore[union-attr]
                  and len(parent.block_table) >= self.block_manager.blocks_for(prompt))  # type: ignore[union-attr]
        pair = self.block_manager.fork(parent, child, prompt) if shared else False  # type: ignore[arg-type]
        if pair is False:
            self.scheduler.add_front(child)
            return
        if pair is not None:  # queued after the step that wrote the prompt's KV (stream order)
            self.runner.cache.copy_blocks([pair[0]], [pair[1]])
        child.num_computed_tokens = prompt
        self.scheduler.add_running(child)

    def _flush(self) -> None:
        self._resolve_inflight()
        self._emit_pending()

    def _emit_pending(self) -> None:
        """Text deltas of the accepted tokens, in order, to their streams."""
        pending, self._pending = self._pending, []
        out = []
        try:
            for state, token, logprob, alternatives, finish in pending:
                delta = state.delta(token, logprob, alternatives, finish)
                if delta.finish_reason is not None and not state.finished:  # a stop string: free first, as below
                    self._finish(state.seq.seq_id, None)
                out.append((state.stream, self._timed(state, delta)))
        finally:  # what was built goes out even if a later delta fails (final deltas of freed requests among them)
            put_many(out)

    def _put(self, state: RequestState, delta: Delta) -> None:
        """To the request's stream; the final delta carries the request's times."""
        state.stream.put(self._timed(state, delta))

    @staticmethod
    def _timed(state: RequestState, delta: Delta) -> Delta:
        if delta.finish_reason is not None:
            return dataclasses.replace(delta, times=state.timer.finish(bool(delta.token_ids)))
        if delta.token_ids and state.timer.first_token is None:
            state.timer.first_token = time.time()
        return delta

    def _stamp_scheduled(self, output: SchedulerOutput) -> None:
        """The first step that computes a request (its samples too) is when it was scheduled."""
        now = time.time()
        for chunk in output.chunks:
            state = self._unscheduled.pop(chunk.seq_id, None)
            if state is not None:
                for scheduled in (state, *state.siblings):
                    scheduled.timer.scheduled = now
            beams = self.beams.of_seq.get(chunk.seq_id)
            if beams is not None and beams.timer.scheduled is None:
                beams.timer.scheduled = now

    def _admit(self, states: list[RequestState]) -> None:
        """The first sample's sequence is queued; the others wait to be forked from it."""
        for state in states:
            self._states[state.seq.seq_id] = state
        self._counts["prompt_tokens"] += len(states[0].seq)
        self._unscheduled[states[0].seq.seq_id] = states[0]
        self.scheduler.add(states[0].seq)

    def _abort(self, request_id: object) -> None:
        self._flush()  # its tokens sampled so far reach its stream before the abort (costs one wait for the GPU)
        beams = self.beams.by_request_id.get(request_id)
        if beams is not None:  # any of its streams aborts the whole search
            self.beams.finish(beams, "abort")
            return
        seq_id = self._seq_of.get(request_id)
        if seq_id is not None and seq_id in self._states:
            self._finish(seq_id, "abort")

    def _finish(self, seq_id: int, reason: str | None) -> None:
        """Free everything of a request; `reason` set: also end its stream (abort, error)."""
        state = self._states.pop(seq_id)
        self._unscheduled.pop(seq_id, None)
        state.finished = True
        with self._cv:  # generate() checks request ids under the same lock
            self._seq_of.pop(state.request_id, None)
        self.scheduler.finish(state.seq)
        if self.speculator is not None:
            self.speculator.release(seq_id)
        if reason is not None:
            self._put(state, state.final_delta(reason, state.stop_strings.flush()))

    def _end_all(self, reason: str) -> None:
        self._flush()
        for seq_id in list(self._states):
            self._finish(seq_id, reason)
        self.beams.finish_all(reason)

    def _admit_beams(self, request: BeamRequest) -> None:
        self._counts["prompt_tokens"] += request.num_prompt_tokens
        self.beams.admit(request)

    def _forget_ids(self, request_ids: list[object]) -> None:
        with self._cv:  # generate() checks request ids under the same lock
            for rid in request_ids:
                self._seq_of.pop(rid, None)

    def _new_seq_id(self) -> int:
        with self._cv:
            self._next_seq_id += 1
            return self._next_seq_id - 1

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
                self._inflight = None  # its samples may be what failed
                with contextlib.suppress(Exception):  # the deltas of tokens accepted before the failure
                    self._emit_pending()
                self._end_all("error")
                continue
            if not self.scheduler.has_work():  # idle next: the last step's deltas go out now
                self._flush()
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
