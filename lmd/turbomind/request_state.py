"""One request's post-processing on the engine thread: sampled token -> grammar, stop checks -> text delta -> stream."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lmd.turbomind.detokenizer import IncrementalDetokenizer
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.request_stream import Delta, PromptEntry, RequestStream, Usage
from lmd.turbomind.request_times import RequestTimer
from lmd.turbomind.sampler import SamplingRow, request_generator
from lmd.turbomind.sequence import Sequence
from lmd.turbomind.stop_strings import StopStringMatcher

if TYPE_CHECKING:
    from lmd.turbomind.guided import GuidedMatcher
    from lmd.turbomind.speculative.request import SpeculativeRequest

_log = logging.getLogger("lmd.engine")


class RequestState:
    def __init__(self, request_id: object, seq: Sequence, config: GenerationConfig, tokenizer: object,
                 eos_ids: tuple[int, ...], max_len: int, stream: RequestStream,
                 matcher: GuidedMatcher | None = None, sample_index: int = 0) -> None:
        self.request_id, self.seq, self.config, self.stream = request_id, seq, config, stream
        # The grammar state after the accepted tokens. It lives here rather than on the sequence's KV, so preemption
        # (recomputing the KV) and prefix reuse leave it as it is.
        self.matcher = matcher
        self.eos_ids, self.max_len = eos_ids, max_len
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.token_ids, config.skip_special_tokens)
        self.stop_strings = StopStringMatcher(config.stop_words)
        # parallel sampling: sample i of a seeded request draws from seed + i (every sample differs, all repeatable)
        self.generator = request_generator(config, offset=sample_index)
        # parallel sampling: on the first sample's state, the others until their rows are sampled; on the others,
        # the sequence they fork from when that sample is resolved
        self.siblings: list[RequestState] = []
        self.fork_parent: Sequence | None = None
        self.finished = False  # set by the engine when it frees the request
        self.timer = RequestTimer()  # queued now; the engine stamps scheduled and first token
        # prompt logprobs (config.prompt_logprobs): one entry per prompt token, None for the first; sent once, with
        # the first delta; `planned`: prompt tokens whose logprobs a scheduled step computes (token 0 has none)
        self.prompt_logprobs: list[PromptEntry] | None = None if config.prompt_logprobs is None else [None]
        self.prompt_logprobs_planned = 1
        self.speculative: SpeculativeRequest | None = None  # set by an engine that speculates
        self._prompt_sent = False

    def sampling_row(self, drafts: tuple[int, ...] = ()) -> SamplingRow:
        """`drafts`: the row of a verification after these proposals (penalties and min_new_tokens see them as
        generated, as they will be if accepted)."""
        ids = self.seq.token_ids + list(drafts) if drafts else self.seq.token_ids
        return SamplingRow(self.config, ids, self.seq.num_generated + len(drafts), self.generator, self.eos_ids,
                           self.matcher)

    def accept(self, token: int) -> str | None:
        """Append the sampled token (and advance the grammar); the finish decided by ids alone (stop or eos token,
        length, "error" for a token the grammar refuses), else None. The scheduler needs this before the next step,
        and the next step's sampling row the advanced grammar; the text (`delta`) may come later."""
        seq, config = self.seq, self.config
        seq.token_ids.append(token)
        if self.matcher is not None and not self.matcher.accept(token):
            # The sampler only draws allowed tokens, so this is a bug (or a mask the logits made all -inf): the
            # request ends with "error" rather than continuing off its grammar.
            _log.error("request %r: the grammar refused sampled token %d; the request ends with an error",
                       self.request_id, token)
            return "error"
        if token in config.stop_token_ids or (token in self.eos_ids and not config.ignore_eos):
            return "stop"
        if seq.num_generated >= config.max_new_tokens or len(seq) >= self.max_len:
            return "length"
        return None

    def delta(self, token: int, logprob: float | None, top: list[tuple[int, float]] | None,
              finish: str | None) -> Delta:
        """The text delta of an accepted token; a stop string may end the request here (finish "stop"). A stop token
        and a token the grammar refused ("error") add no text."""
        silent = finish in ("stop", "error")
        text, hit = self.stop_strings.push("" if silent else self.detokenizer.push(token))
        if hit:
            finish = "stop"
        elif finish is not None:
            tail, hit = self.stop_strings.push(self.detokenizer.flush())
            text += tail if hit else tail + self.stop_strings.flush()
        return Delta(self.request_id, text, (token,), finish, self.usage() if finish else None,
                     None if logprob is None else (logprob,), None if top is None else (tuple(top),),
                     self._take_prompt_logprobs())

    def usage(self) -> Usage:
        seq = self.seq
        return Usage(seq.num_prompt_tokens, seq.num_generated, min(seq.num_prefix_hit_tokens, seq.num_prompt_tokens))

    def final_delta(self, reason: str, text: str = "") -> Delta:
        return Delta(self.request_id, text, (), reason, self.usage(), prompt_logprobs=self._take_prompt_logprobs())

    def _take_prompt_logprobs(self) -> tuple[PromptEntry, ...] | None:
        if self.prompt_logprobs is None or self._prompt_sent:
            return None
        self._prompt_sent = True
        return tuple(self.prompt_logprobs)
