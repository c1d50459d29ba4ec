"""A beam-search request in the engine: its running beams as sequences in the persistent batch, their KV shared.

Every running beam is a `Sequence` that decodes like any other. When a beam's step yields logits its top
continuations are recorded and the beam idles (no new token); when every beam of the round has reported, the
round is decided (`BeamSearch.advance`) and the beams are rebuilt from their parents:
- a parent's first child is the parent's own sequence, extended by the chosen token;
- each further child is a new sequence forked from the parent: full KV blocks shared by reference count, the
  partly filled last block copied (copy-on-write); with no free block for the copy (or tp > 1, where blocks are
  copied on rank 0 only) it is queued to recompute its tokens, mostly prefix-cache hits;
- a parent with no child is freed, after the forks, so the blocks it shares stay referenced.
A preempted beam recomputes its tokens and reports again; its siblings wait idle meanwhile. The request's n streams
get one delta each when the search ends: the n best hypotheses, best first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lmd.turbomind.beam_search import BeamSearch, Candidate, Hypothesis
from lmd.turbomind.detokenizer import IncrementalDetokenizer
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.request_stream import Delta, RequestStream, Usage
from lmd.turbomind.request_times import RequestTimer
from lmd.turbomind.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from lmd.turbomind.block_manager import BlockManager
    from lmd.turbomind.scheduler import Scheduler


class BeamRequest:
    def __init__(self, request_ids: list[object], streams: list[RequestStream], prompt: Sequence,
                 config: GenerationConfig, end_ids: tuple[int, ...], max_new_tokens: int) -> None:
        self.request_ids, self.streams, self.config = request_ids, streams, config
        self.search = BeamSearch(config.beam_width, config.length_penalty, config.early_stopping, end_ids,
                                 max_new_tokens)
        self.beams: list[Sequence] = [prompt]
        self.num_prompt_tokens = len(prompt.token_ids)
        prompt.num_reserved_forks = config.beam_width - 1  # batch slots the beams take once the prompt is done
        self.timer = RequestTimer()
        self.prefix_hit_tokens = 0
        self._reported: dict[int, list[Candidate]] = {}  # beam index -> its candidates this round

    @property
    def num_candidates(self) -> int:
        return self.search.num_candidates

    def report(self, seq_id: int, logprobs: torch.Tensor, token_ids: torch.Tensor) -> bool:
        """A beam's top logprobs of this round (host tensors); True when every beam has reported."""
        beam = next(i for i, seq in enumerate(self.beams) if seq.seq_id == seq_id)
        if self.search.num_generated == 0:
            self.prefix_hit_tokens = min(self.beams[0].num_prefix_hit_tokens, self.num_prompt_tokens)
        self._reported[beam] = self.search.candidates(beam, logprobs, token_ids)
        return len(self._reported) == len(self.beams)

    def advance(self, scheduler: Scheduler, block_manager: BlockManager, copy_blocks: Callable[[int, int], None],
                new_seq_id: Callable[[], int], can_share: bool) -> None:
        """Decide the round and rebuild the beams. After the last round the beams are left as they are (`done`): the
        caller frees them with `release`."""
        candidates = [c for beam in sorted(self._reported) for c in self._reported[beam]]
        self._reported.clear()
        chosen = self.search.advance(candidates)
        if not chosen:
            return
        parents = self.beams
        parents[0].num_reserved_forks = 0
        beams: list[Sequence] = []
        first_child: dict[int, int] = {}  # parent beam -> the token its own sequence takes
        for c in chosen:
            parent = parents[c.beam]
            if c.beam not in first_child:  # appended below, once every fork has read the parent's tokens
                first_child[c.beam] = c.token
                beams.append(parent)
                continue
            child = Sequence(new_seq_id(), parent.token_ids + [c.token], num_prompt_tokens=self.num_prompt_tokens)
            shared = (can_share and parent.status is SequenceStatus.RUNNING
                      and parent.num_computed_tokens == len(parent.token_ids))
            pair = block_manager.fork(parent, child, len(parent.token_ids)) if shared else False
            if pair is False:
                scheduler.add_front(child)
            else:
                if pair is not None:
                    copy_blocks(*pair)  # queued after the step that wrote the parent's KV (stream order)
                child.num_computed_tokens = len(parent.token_ids)
                scheduler.add_running(child)
            beams.append(child)
        for beam, token in first_child.items():
            parents[beam].token_ids.append(token)
        for i, parent in enumerate(parents):
            if i not in first_child:
                scheduler.finish(parent)
        self.beams = beams

    def release(self, scheduler: Scheduler) -> None:
        for beam in self.beams:
            if beam.status is not SequenceStatus.FINISHED:
                scheduler.finish(beam)

    def final_deltas(self, tokenizer: object, reason: str | None = None) -> list[Delta]:
        """One delta per stream: the n best hypotheses, best first (or, with `reason`, empty ends: abort, error)."""
        times = self.timer.finish(reason is None)
        if reason is not None:
            usage = Usage(self.num_prompt_tokens, 0, self.prefix_hit_tokens)
            return [Delta(rid, "", (), reason, usage, times=times) for rid in self.request_ids]
        best = self.search.best(len(self.streams))
        return [self._delta(rid, hypothesis, tokenizer, times) for rid, hypothesis in zip(self.request_ids, best,
                                                                                        strict=True)]

    def _delta(self, request_id: object, hypothesis: Hypothesis, tokenizer: object, times: object) -> Delta:
        tokens = hypothesis.token_ids
        shown = tokens[:-1] if hypothesis.ends_by_token else tokens  # a stop token adds no text
        prompt_tail = self.beams[0].token_ids[:self.num_prompt_tokens]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_tail, self.config.skip_special_tokens)
        text = "".join(detokenizer.push(t) for t in shown) + detokenizer.flush()
        usage = Usage(self.num_prompt_tokens, len(tokens), self.prefix_hit_tokens)
        return Delta(request_id, text, tokens, "stop" if hypothesis.ends_by_token else "length", usage,
                     times=times)  # type: ignore[arg-type]
