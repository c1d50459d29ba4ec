"""A request before it is queued: its prompt as token ids and the checks it must pass. One definition, used by the
engine and by the engine-core client (which encodes and refuses requests in the caller's process, before they cross
to the engine process)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lmd.errors import LmdError
from lmd.turbomind.gen_config import GenerationConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lmd.chat_templates import ChatTemplate
    from lmd.turbomind.speculative.config import SpeculativeConfig

Prompt = str | list[dict[str, str]] | list[int]


def encode_prompt(prompt: Prompt, tokenizer: PreTrainedTokenizerBase, chat_template: ChatTemplate,
                  apply_chat_template: bool = True) -> list[int]:
    """Token ids as they are; text through the chat template as one user turn (or tokenized as it is, without
    the template); messages through the chat template."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, str) and not apply_chat_template:
        return list(tokenizer(prompt)["input_ids"])
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return chat_template.encode(messages, tokenizer)  # type: ignore[arg-type]


def checked_request(config: GenerationConfig, token_ids: list[int], *, vocab_size: int, max_batch_size: int,
                    max_len: int, speculative: SpeculativeConfig | None = None) -> GenerationConfig:
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
    if speculative is not None and (samples > 1 or config.guided is not None):
        raise LmdError("speculative decoding serves one sample per prompt without a structured output; "
                       "drop n / best_of / guided, or start the engine without speculative")
    return config
