"""Response bodies and stream chunks of /v1/chat/completions and /v1/completions, built from the engine's deltas."""

from __future__ import annotations

import time
import uuid
from typing import Any

from lmd.turbomind.request_stream import Delta, Response, Usage


def new_request_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class ResponseBuilder:
    """One request's response: a whole body (`full`) or its stream chunks (`chunk`, `usage_chunk`)."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer: Any, logprobs: bool, token_ids: bool) -> None:
        self.request_id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self._logprobs, self._token_ids = logprobs, token_ids
        self._text_offset = 0  # completions' logprobs.text_offset runs across chunks

    # ---- whole response ----

    def full(self, response: Response) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": response.finish_reason}
        logprobs = self._logprobs_body(response.token_ids, response.logprobs, response.top_logprobs)
        if self.chat:
            choice["message"] = {"role": "assistant", "content": response.text}
        else:
            choice["text"] = response.text
        choice["logprobs"] = logprobs
        if self._token_ids:
            choice["token_ids"] = list(response.token_ids)
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = usage_body(response.usage)
        return body

    # ---- streaming ----

    def role_chunk(self, include_usage: bool) -> dict[str, Any]:
        """Chat streams open with the assistant role and empty content, as OpenAI's do."""
        body = self._chunk(
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        )
        if include_usage:
            body["usage"] = None
        return body

    def chunk(self, delta: Delta, include_usage: bool) -> dict[str, Any] | None:
        """The chunk of one delta, or None when it carries nothing to show (text held back, no extras asked)."""
        extras = self._logprobs or self._token_ids
        if not delta.text and delta.finish_reason is None and not (extras and delta.token_ids):
            return None
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        else:
            choice["text"] = delta.text
        choice["logprobs"] = self._logprobs_body(list(delta.token_ids), delta.logprobs, delta.top_logprobs)
        choice["finish_reason"] = delta.finish_reason
        if self._token_ids:
            choice["token_ids"] = list(delta.token_ids)
        body = self._chunk(choice)
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage_body(usage)
        return body

    # ---- parts ----

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs_body(self, token_ids: list[int], logprobs: Any, top: Any) -> dict[str, Any] | None:
        if not self._logprobs or logprobs is None:
            return None
        tops = list(top) if top is not None else [()] * len(token_ids)
        if self.chat:
            content = [
                {**self._token_entry(t, lp), "top_logprobs": [self._token_entry(a, alp) for a, alp in alts]}
                for t, lp, alts in zip(token_ids, logprobs, tops, strict=True)
            ]
            return {"content": content}
        texts = [self._token_text(t) for t in token_ids]
        offsets = []
        for text in texts:
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        top_maps = [{self._token_text(a): alp for a, alp in alts} for alts in tops]
        return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": top_maps, "text_offset": offsets}

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)
