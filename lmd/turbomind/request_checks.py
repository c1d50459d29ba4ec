"""What a request must satisfy before it is queued: one definition, used by the engine and by the engine-core
client (which refuses a request in the caller's process, before it crosses to the engine process)."""

from __future__ import annotations

import dataclasses

from lmd.errors import LmdError
from lmd.turbomind.gen_config import GenerationConfig


def checked_request(config: GenerationConfig, token_ids: list[int], *, vocab_size: int, max_batch_size: int,
                    max_len: int) -> GenerationConfig:
    """The config the request runs with (best_of ranks samples by cumulative logprob, so it gets logprobs), or an
    LmdError naming what is wrong and the fix."""
    config.check_vocab(vocab_size)
    samples = config.num_samples
    if samples > config.n and config.logprobs is None:
        config = dataclasses.replace(config, logprobs=0)
    if samples > max_batch_size:
        raise LmdError(f"{samples} samples (n / best_of) of one prompt need {samples} batch slots; this engine "
                       f"has max_batch_size={max_batch_size}; ask for fewer or raise it")
    if not token_ids:
        raise LmdError("the prompt is empty; give text, messages or at least one token id")
    if len(token_ids) >= max_len:
        raise LmdError(f"the prompt has {len(token_ids)} tokens; this engine holds at most {max_len} "
                       "per session (session_len / KV cache); shorten it or raise session_len")
    return config
