"""Benchmark requests: seeded samples of a prompt set, tokenized and length-filtered, or synthetic token-id prompts.

Output length of a sampled request, first rule that applies:
1. `fixed_output_len`: exactly that many tokens (EOS ignored);
2. the conversation has a reply: its token count, capped at `max_output_len`, exactly (EOS ignored, vLLM-style);
3. otherwise up to `max_output_len` tokens; the model may stop earlier at EOS (first-turn-only files such as the
   bundled ShareGPT sets have no replies).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lmd.bench.dataset import Conversation
from lmd.errors import LmdError


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: tuple[int, ...]
    output_len: int  # max_new_tokens of the request
    exact: bool  # True: EOS is ignored, so exactly output_len tokens come back
    text: str | None = None  # the prompt before tokenization (sampled from a conversation); None for random ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class SamplingConfig:
    num_prompts: int = 1000
    seed: int = 0
    min_input_len: int = 4
    max_input_len: int = 1024
    max_output_len: int = 256
    fixed_output_len: int | None = None
    max_total_len: int | None = None  # prompt + output must fit the engine's session (Engine.max_len)

    def __post_init__(self) -> None:
        for flag, value in (
            ("--num-prompts", self.num_prompts),
            ("--min-input-len", self.min_input_len),
            ("--max-output-len", self.max_output_len),
        ):
            if value < 1:
                raise LmdError(f"{flag} must be at least 1 (got {value})")
        if self.max_input_len < self.min_input_len:
            raise LmdError(
                f"--max-input-len {self.max_input_len} is below --min-input-len {self.min_input_len}; raise it"
            )
        if self.fixed_output_len is not None and self.fixed_output_len < 1:
            raise LmdError(f"--fixed-output-len must be at least 1 (got {self.fixed_output_len})")


def sample_requests(
    conversations: Sequence[Conversation],
    encode: Callable[[str], list[int]],
    count_tokens: Callable[[str], int],
    config: SamplingConfig,
) -> list[BenchRequest]:
    """`num_prompts` requests drawn in a seeded random order; prompts outside the length limits are skipped.

    Only the drawn prompts are tokenized, so a large file costs little when few prompts are asked for."""
    order = list(range(len(conversations)))
    random.Random(config.seed).shuffle(order)
    out: list[BenchRequest] = []
    for index in order:
        if len(out) == config.num_prompts:
            break
        conversation = conversations[index]
        prompt_ids = encode(conversation.prompt)
        if not config.min_input_len <= len(prompt_ids) <= config.max_input_len:
            continue
        output_len, exact = _output_len(conversation, count_tokens, config)
        if output_len < 1:
            continue
        if config.max_total_len is not None and len(prompt_ids) + output_len > config.max_total_len:
            continue
        out.append(BenchRequest(tuple(prompt_ids), output_len, exact, conversation.prompt))
    if len(out) < config.num_prompts:
        room = "" if config.max_total_len is None else f", prompt + output <= {config.max_total_len} (session)"
        raise LmdError(
            f"only {len(out)} of {len(conversations)} prompts pass the length filters "
            f"({config.min_input_len}..{config.max_input_len} input tokens{room}); lower --num-prompts "
            "or widen --min-input-len/--max-input-len"
        )
    return out


def random_requests(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0, exclude: Sequence[int] = ()
) -> list[BenchRequest]:
    """Prompts of exactly `input_len` random token ids (never one of `exclude`, e.g. EOS), each asking for exactly
    `output_len` tokens. Distinct seeds give distinct prompts, so the prefix cache cannot shorten a prefill."""
    if input_len < 1 or output_len < 1:
        raise LmdError(f"input and output lengths must be at least 1 (got {input_len} and {output_len})")
    banned = set(exclude)
    if vocab_size <= len(banned):
        raise LmdError(f"vocab_size={vocab_size} leaves no token to build random prompts from")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        ids: list[int] = []
        while len(ids) < input_len:
            token = rng.randrange(vocab_size)
            if token not in banned:
                ids.append(token)
        requests.append(BenchRequest(tuple(ids), output_len, exact=True))
    return requests


def _output_len(
    conversation: Conversation, count_tokens: Callable[[str], int], config: SamplingConfig
) -> tuple[int, bool]:
    if config.fixed_output_len is not None:
        return config.fixed_output_len, True
    if conversation.reply is not None:
        return min(count_tokens(conversation.reply), config.max_output_len), True
    return config.max_output_len, False
