"""One request's token sequence as the scheduler and block manager see it: ids, progress, KV blocks. No tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

INFLIGHT = -1  # a token id in a scheduled chunk: the token the step still running samples for this sequence


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int = -1
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache; the rest are computed by coming steps
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hash of each full block already committed
    num_prefix_hit_tokens: int = 0  # summed over admissions (a preempted sequence is admitted again)
    num_preemptions: int = 0
    # Overlap: tokens sampled on the device whose ids have not reached the host yet (0 or 1). They count as known
    # tokens for scheduling; token_ids gets them when the engine resolves the step.
    num_inflight: int = 0
    max_num_tokens: int = 1 << 62  # the request ends by length here: an in-flight token at it needs no step
    num_reserved_forks: int = 0  # parallel sampling: sequences forked from this one at its first sample
    prompt_logits: bool = False  # every prompt position's logits are wanted (prompt logprobs): no prefix-cache hits
    # Speculative decoding: tokens proposed to follow the known ones, verified by the next step (set by the engine
    # before scheduling, consumed by the scheduler; their KV counts as computed only once they are accepted)
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Known tokens, in-flight ones included."""
        return len(self.token_ids) + self.num_inflight

    @property
    def num_uncomputed(self) -> int:
        if self.num_inflight and self.num_tokens >= self.max_num_tokens:
            return 0  # the in-flight token is the last one: nothing more will be computed
        return self.num_tokens - self.num_computed_tokens
