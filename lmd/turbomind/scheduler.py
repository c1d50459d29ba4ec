"""Persistent batching: which sequences compute which tokens this step. Plain data in, plain data out.

Ordering rules of one `schedule()`:
1. Running sequences, oldest first, each get their next chunk (1 token when decoding, up to the remaining budget
   when still prefilling) out of the step's token budget `max_tokens_per_step`.
2. A running sequence that cannot get KV blocks preempts the newest running sequence (possibly itself): its blocks
   are freed and it goes back to the front of the waiting queue, to be recomputed (its full blocks stay in the
   prefix cache, so the recompute is often a cache hit).
3. Only when nothing was preempted, waiting sequences are admitted in FIFO order while a slot
   (`max_batch_size`), budget and blocks remain; a long prompt is prefilled in chunks over several steps. The
   prompt's cached prefix (whole blocks) is taken from the block manager, not computed.
4. Admission runs at every step that would compute nothing else, or while at most half the slots are taken and the
   last admission did not stop for want of KV blocks, or when the waiting prompts that the free slots would take
   fill the step's token budget (a burst); otherwise (refills of a full batch, or of a full pool) at most every
   `step_length` steps. A step with prefill tokens runs eagerly (decode-only steps replay CUDA graphs), so when
   requests end one by one in a full batch, admitting at each step would make nearly every step an eager one;
   waiting a few steps gathers the freed slots' prefills into one step instead (LMDeploy's PyTorch engine has a
   like rule, `prefill_interval`). An under-filled engine, the interactive case, never waits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from lmd.turbomind.block_manager import BlockManager
from lmd.turbomind.sequence import INFLIGHT, Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledChunk:
    seq_id: int
    token_ids: tuple[int, ...]  # INFLIGHT where the step still running samples the token
    start: int  # position of token_ids[0] in the sequence
    block_table: tuple[int, ...]
    needs_logits: bool  # the chunk ends the sequence's known tokens: sample the next one
    all_logits: bool = False  # logits of every position (prompt logprobs); the last is the sampling row if any
    num_draft: int = 0  # speculative decoding: the last num_draft ids are proposals; logits of the last 1 + num_draft


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_tokens_per_step: int,
                 step_length: int = 1) -> None:
        self.block_manager = block_manager
        self.max_batch_size, self.max_tokens_per_step, self.step_length = max_batch_size, max_tokens_per_step, step_length
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._seqs: dict[int, Sequence] = {}
        self._since_admission = step_length  # steps since the last one that admitted: the first step may
        self._pool_full = False  # the last admission stopped for want of KV blocks: the pool caps the batch
        self.prefix_hit_tokens = 0  # over all admissions

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_tokens_per_step
        chunks: list[ScheduledChunk] = []
        preempted: list[int] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            if n == 0:  # nothing new yet (the engine has not appended its sampled token)
                i += 1
                continue
            drafts = seq.draft_token_ids[:budget - n] if n == seq.num_uncomputed else []
            while not self.block_manager.append_slots(seq, n + len(drafts)):
                if drafts:  # short of blocks: verify nothing rather than preempt anyone for proposals
                    drafts = []
                    continue
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            else:
                chunks.append(_chunk(seq, n, drafts))
                budget -= n + len(drafts)
                i += 1
        # batch slots taken: running sequences and the forks they will make at their first sample (parallel sampling)
        slots = len(self.running) + sum(s.num_reserved_forks for s in self.running) if self.waiting else 0
        due = (self._since_admission >= self.step_length or not chunks
               or (2 * slots <= self.max_batch_size and not self._pool_full)
               or (not self._pool_full and self._fills_budget(self.max_batch_size - slots, budget)))
        admit = not preempted and due
        admitted = False
        if admit and self.waiting:
            self._pool_full = False  # until this admission stops for want of blocks
        while admit and self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.num_inflight:  # preempted while its last token was being sampled: admitted once it is known
                break
            if slots + 1 + seq.num_reserved_forks > self.max_batch_size:
                break
            matched = [] if seq.prompt_logits else self.block_manager.match_prefix(seq.token_ids)
            hit = len(matched) * self.block_manager.block_size
            n = min(len(seq) - hit, budget)
            if not self.block_manager.can_admit(matched, hit + n):
                self._pool_full = True
                break
            self.waiting.popleft()
            self.block_manager.admit(seq, matched, hit + n)
            seq.num_computed_tokens = hit
            seq.num_prefix_hit_tokens += hit
            self.prefix_hit_tokens += hit
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            slots += 1 + seq.num_reserved_forks
            chunks.append(_chunk(seq, n))
            budget -= n
            admitted = True
        self._since_admission = 1 if admitted else self._since_admission + 1
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _fills_budget(self, free_slots: int, budget: int) -> bool:
        """The prompts that the free slots would admit hold at least the step's remaining token budget (a burst of
        arrivals, not the trickle of refills that rule 4 gathers)."""
        tokens = 0
        for i, seq in enumerate(self.waiting):
            if i >= free_slots:
                return False
            tokens += seq.num_uncomputed
            if tokens >= budget:
                return True
        return False

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked with its KV blocks in place (parallel sampling): it decodes from the next step."""
        seq.status = SequenceStatus.RUNNING
        self._seqs[seq.seq_id] = seq
        self.running.append(seq)

    def add_front(self, seq: Sequence) -> None:
        """A fork that could not share its parent's blocks: first in the queue, its prompt mostly a prefix hit."""
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self.waiting.appendleft(seq)

    def complete_step(self, output: SchedulerOutput) -> None:
        """The step's KV is in the cache: advance each sequence and publish its newly full blocks."""
        for chunk in output.chunks:
            seq = self._seqs[chunk.seq_id]
            seq.num_computed_tokens = chunk.start + len(chunk.token_ids) - chunk.num_draft  # drafts: once accepted
            self.block_manager.commit_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Completed or aborted: free the blocks at once, whatever state the sequence is in."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._seqs.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED

    def preempt(self, seq: Sequence, to_back: bool = False) -> None:
        """Free a running sequence's blocks; it is recomputed when admitted again (first in the queue, or last)."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        if to_back:
            self.waiting.append(seq)
        else:
            self.waiting.appendleft(seq)


def _chunk(seq: Sequence, n: int, drafts: list[int] | None = None) -> ScheduledChunk:
    start = seq.num_computed_tokens
    ids = seq.token_ids[start:start + n]
    ids += [INFLIGHT] * (n - len(ids))  # the runner takes these from the device (overlap)
    return ScheduledChunk(seq.seq_id, tuple(ids + (drafts or [])), start, tuple(seq.block_table),
                          start + n == seq.num_tokens, seq.prompt_logits and start + 1 < seq.num_prompt_tokens,
                          len(drafts or ()))
