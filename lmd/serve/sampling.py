"""Request fields -> the engine's GenerationConfig; its validation messages come back naming the request's field."""

from __future__ import annotations

import re
from typing import Any

from lmd.errors import LmdError
from lmd.serve.errors import ApiError, bad_request
from lmd.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from lmd.serve.structured_outputs import StructuredOutput
from lmd.turbomind.gen_config import GenerationConfig

_CONFIG_FIELD = re.compile(r"GenerationConfig\.(\w+)=")


def generation_config(request: ChatCompletionRequest | CompletionRequest, room: int, vocab_size: int,
                      structured: StructuredOutput | None = None) -> GenerationConfig:
    """`room`: tokens the engine can still generate after this prompt (the default max_tokens); `structured`: the
    grammar the reply follows (response_format, guided_*, a forced tool call)."""
    found = request.unsupported()
    if found is not None:
        raise bad_request(*found)
    limit_field, limit = request.token_limit
    if limit is not None and limit > room > 0:  # OpenAI and vLLM refuse this rather than clamp it
        raise bad_request(limit_field, f"{limit_field}={limit} is more than the {room} tokens this request has room "
                                       f"for after its prompt (max_model_len minus the prompt); send at most {room}")
    min_field = "min_tokens" if request.min_tokens is not None else "min_new_tokens"
    values: dict[str, tuple[str, Any]] = {  # GenerationConfig field -> (request field, value)
        "max_new_tokens": (limit_field, room if limit is None else limit),
        "min_new_tokens": (min_field, _first(request.min_tokens, request.min_new_tokens, 0)),
        "temperature": ("temperature", request.temperature),
        "top_k": ("top_k", 0 if request.top_k == -1 else request.top_k),
        "top_p": ("top_p", request.top_p),
        "repetition_penalty": ("repetition_penalty", request.repetition_penalty),
        "presence_penalty": ("presence_penalty", request.presence_penalty or 0.0),
        "frequency_penalty": ("frequency_penalty", request.frequency_penalty or 0.0),
        "logit_bias": ("logit_bias", _logit_bias(request)),
        "min_p": ("min_p", request.min_p),
        "seed": ("seed", request.seed),
        "ignore_eos": ("ignore_eos", request.ignore_eos),
        "stop_token_ids": ("stop_token_ids", request.stop_token_ids or ()),
        "stop_words": ("stop", _stop_words(request)),
        "logprobs": (
            "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs",
            request.logprobs_count,
        ),
        # echo + logprobs: the prompt's logprobs too, from the same prefill (completions only)
        "prompt_logprobs": ("logprobs", request.logprobs if getattr(request, "echo", False) else None),
        "skip_special_tokens": ("skip_special_tokens", request.skip_special_tokens),
        "n": ("n", 1 if request.n is None else request.n),
        "best_of": ("best_of", None if request.use_beam_search else request.best_of),
        # vLLM's beam search: best_of beams wide (n when best_of is unset), the n best returned
        "beam_width": ("best_of", request.best_of or request.n or 1) if request.use_beam_search else ("best_of", 1),
        "length_penalty": ("length_penalty", request.length_penalty),
        "early_stopping": ("early_stopping", request.early_stopping),
        "guided": ("guided", None) if structured is None else (structured.field, structured.spec),
    }
    try:
        config = GenerationConfig(**{name: value for name, (_, value) in values.items()})
        config.check_vocab(vocab_size)
        return config
    except LmdError as exc:
        raise _renamed(str(exc), {name: field for name, (field, _) in values.items()}) from None


def _stop_words(request: SamplingRequest) -> tuple[str, ...]:
    stop = request.stop
    if stop is None:
        return ()
    words = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not w for w in words):
        raise bad_request("stop", "stop holds an empty string; every stop string needs at least one character")
    return words


def _logit_bias(request: SamplingRequest) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys, i.e. strings."""
    out = {}
    for key, bias in (request.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request("logit_bias", f"logit_bias key {key!r} is not a token id; use integer ids") from None
        out[token] = bias
    return out


def _first(*values: int | None) -> int:
    return next(v for v in values if v is not None)  # type: ignore[return-value]


def _renamed(message: str, field_of: dict[str, str]) -> ApiError:
    """ "GenerationConfig.max_new_tokens=0 is invalid; ..." -> "max_tokens=0 is invalid; ..." with param set."""
    match = _CONFIG_FIELD.search(message)
    if match is None:
        return bad_request(None, message)
    field = field_of.get(match.group(1), match.group(1))
    return bad_request(field, _CONFIG_FIELD.sub(f"{field}=", message, count=1))
