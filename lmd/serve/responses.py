"""Response bodies and stream chunks of /v1/chat/completions and /v1/completions, built from the engine's deltas.

A response has n choices per prompt, prompt by prompt: a choice's position among the streams (as `generation.submit`
orders them) is its OpenAI index. Chat replies may go through a reasoning parser (`reasoning_content` apart from the
content) and then a tool-call parser (one of each per choice), which turns the content into text and `tool_calls`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmd.serve.reasoning import Reasoning, ReasoningParser
from lmd.serve.tool_parsers import Piece, ToolCall, ToolCallParser
from lmd.turbomind.request_stream import Delta, Response, Usage

ParserFactory = Callable[[], ToolCallParser]
ReasoningFactory = Callable[[], ReasoningParser]


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


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class _Choice:
    """Per-choice state that runs across a stream's chunks."""

    def __init__(self, parser: ToolCallParser | None, reasoning: ReasoningParser | None) -> None:
        self.parser, self.reasoning = parser, reasoning
        self.text_offset = 0  # completions' logprobs.text_offset
        self.echoed = False  # completions' echo: the prompt went out (with the first chunk)


class ResponseBuilder:
    """One request's response: a whole body (`full`) or its stream chunks (`chunks`, `usage_chunk`)."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer: Any, logprobs: bool, token_ids: bool,
                 tool_parser: ParserFactory | None = None, echo: Sequence[EchoedPrompt] | None = None,
                 n: int = 1, reasoning: ReasoningFactory | None = None) -> None:
        """`echo` (completions): per prompt, its text and token ids, returned before the completion's. `n`: choices
        per prompt; choices come prompt by prompt, so a choice's position is its OpenAI index. `reasoning` (chat):
        a reasoning parser per choice; its messages then carry `reasoning_content` (null when there was none)."""
        self._echo, self._n = echo, n
        self._prompt_entries: dict[int, list[Any]] = {}
        self.request_id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self._logprobs, self._token_ids = logprobs, token_ids
        self._new_parser, self._new_reasoning = tool_parser, reasoning
        self._choices: dict[int, _Choice] = {}

    @property
    def samples_per_prompt(self) -> int:
        return self._n

    # ---- whole response ----

    def full(self, responses: Sequence[Response], usage: Usage | None) -> dict[str, Any]:
        """`responses`: n per prompt, prompt by prompt; `usage`: the request's (with best_of, of every sample)."""
        choices = []
        for index, response in enumerate(responses):
            prompt_index = index // self._n
            state = self._choice(index)
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                pieces = self._parsed(state, response.text, final=True)
                calls = [p for p in pieces if isinstance(p, ToolCall)]
                content = "".join(p for p in pieces if isinstance(p, str))
                message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
                if state.reasoning is not None:
                    message["reasoning_content"] = "".join(p.text for p in pieces if isinstance(p, Reasoning)) or None
                if calls:
                    message["tool_calls"] = [_call_body(c) for c in calls]
                choice["message"] = message
                choice["finish_reason"] = _finish_reason(response.finish_reason, bool(calls))
            else:
                choice["text"] = response.text
                choice["finish_reason"] = response.finish_reason
            echoed = self._echo_part(state, prompt_index, response.prompt_logprobs)
            if echoed is not None:
                choice["text"] = echoed[0] + choice["text"]
            choice["logprobs"] = _joined(echoed and echoed[1], self._logprobs_body(
                state, response.token_ids, response.logprobs, response.top_logprobs))
            if self._token_ids:
                choice["token_ids"] = list(response.token_ids)
            choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage_body(usage)
        return body

    # ---- streaming ----

    def role_chunks(self, count: int, include_usage: bool) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role and empty content, as OpenAI's do, one chunk per choice."""
        return [
            self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}, include_usage)
            for i in range(count)
        ]

    def chunks(self, index: int, delta: Delta, include_usage: bool) -> list[dict[str, Any]]:
        """The chunks of one delta of stream `index` (n per prompt): none when it carries nothing to show (text
        held back, no extras asked); with a tool-call parser, a call is two chunks (id, type and name; then the
        arguments) as OpenAI streams them."""
        prompt_index = index // self._n
        state = self._choice(index)
        extras = (self._logprobs or self._token_ids) and bool(delta.token_ids)
        finished = delta.finish_reason is not None
        if not self.chat:
            echoed = self._echo_part(state, prompt_index, delta.prompt_logprobs)
            if not delta.text and not finished and not extras and echoed is None:
                return []
            body = {"index": index, "text": delta.text, **self._extras(state, delta),
                    "finish_reason": delta.finish_reason}
            if echoed is not None:
                body["text"] = echoed[0] + body["text"]
                body["logprobs"] = _joined(echoed[1], body["logprobs"])
            return [self._chunk(body, include_usage)]
        pieces = self._parsed(state, delta.text, final=finished)
        deltas = [d for p in pieces for d in _piece_deltas(p)]
        if not deltas and (extras or finished):
            deltas = [{"content": ""} if not finished else {}]
        out = []
        for k, body in enumerate(deltas):
            choice: dict[str, Any] = {"index": index, "delta": body}
            if k == 0:
                choice.update(self._extras(state, delta))
            else:
                choice["logprobs"] = None
            last = k == len(deltas) - 1
            called = state.parser is not None and state.parser.calls_found > 0
            choice["finish_reason"] = _finish_reason(delta.finish_reason, called) if last else None
            out.append(self._chunk(choice, include_usage))
        return out

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage_body(usage)
        return body

    # ---- parts ----

    def _choice(self, index: int) -> _Choice:
        if index not in self._choices:
            self._choices[index] = _Choice(self._new_parser() if self._new_parser is not None else None,
                                           self._new_reasoning() if self._new_reasoning is not None else None)
        return self._choices[index]

    def _parsed(self, state: _Choice, text: str, final: bool) -> list[Piece | Reasoning]:
        """The reasoning first split off, then the content through the tool-call parser, in reply order."""
        parts: list[str | Reasoning] = [text] if text else []
        if state.reasoning is not None:
            parts = state.reasoning.feed(text) + (state.reasoning.finish() if final else [])
        if state.parser is None:
            return list(parts)
        pieces: list[Piece | Reasoning] = []
        for part in parts:
            pieces += [part] if isinstance(part, Reasoning) else state.parser.feed(part)
        return pieces + state.parser.finish() if final else pieces

    def _extras(self, state: _Choice, delta: Delta) -> dict[str, Any]:
        extras: dict[str, Any] = {
            "logprobs": self._logprobs_body(state, list(delta.token_ids), delta.logprobs, delta.top_logprobs)
        }
        if self._token_ids:
            extras["token_ids"] = list(delta.token_ids)
        return extras

    def _chunk(self, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if include_usage:
            body["usage"] = None
        return body

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _echo_part(self, state: _Choice, prompt_index: int, entries: Any) -> tuple[str, dict[str, Any] | None] | None:
        """The echoed prompt once per choice: its text and (with logprobs) its tokens' logprobs, the first token's
        null as OpenAI and vLLM give it. Called before the completion's own logprobs (text offsets run on)."""
        if self._echo is None or state.echoed:
            return None
        state.echoed = True
        prompt = self._echo[prompt_index]
        if not self._logprobs:
            return prompt.text, None
        if entries is not None:  # the first sample of a prompt carries them; its siblings reuse them
            self._prompt_entries[prompt_index] = list(entries)
        entries = self._prompt_entries.get(prompt_index, [None] * len(prompt.token_ids))
        return prompt.text, self._text_logprobs(state, prompt.token_ids, [None if e is None else e[0] for e in entries],
                                                [None if e is None else e[1] for e in entries])

    def _logprobs_body(self, state: _Choice, token_ids: list[int], logprobs: Any, top: Any) -> dict[str, Any] | None:
        if not self._logprobs or logprobs is None:
            return None
        tops = list(top) if top is not None else [()] * len(token_ids)
        if self.chat:
            content = [
                {**self._token_entry(t, lp), "top_logprobs": [self._token_entry(a, alp) for a, alp in alts]}
                for t, lp, alts in zip(token_ids, logprobs, tops, strict=True)
            ]
            return {"content": content}
        return self._text_logprobs(state, token_ids, logprobs, tops)

    def _text_logprobs(self, state: _Choice, token_ids: Sequence[int], logprobs: Sequence[float | None],
                       tops: Sequence[Any]) -> dict[str, Any]:
        """Completions' logprobs object (a None entry: no logprob, as the first echoed prompt token has); text
        offsets run on across the choice's echoed prompt and chunks."""
        texts = [self._token_text(t) for t in token_ids]
        offsets = []
        for text in texts:
            offsets.append(state.text_offset)
            state.text_offset += len(text)
        top_maps = [None if alts is None else {self._token_text(a): alp for a, alp in alts} for alts in tops]
        return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": top_maps, "text_offset": offsets}

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass(frozen=True)
class EchoedPrompt:
    text: str  # as the request gave it (token-id prompts: decoded)
    token_ids: tuple[int, ...]


def _joined(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """Completions' logprobs of the echoed prompt, then of the completion (each list concatenated)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def _call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _piece_deltas(piece: Piece | Reasoning) -> list[dict[str, Any]]:
    if isinstance(piece, str):
        return [{"content": piece}]
    if isinstance(piece, Reasoning):
        return [{"reasoning_content": piece.text}]
    head = {"index": piece.index, "id": piece.id, "type": "function", "function": {"name": piece.name,
                                                                                    "arguments": ""}}
    return [{"tool_calls": [head]}, {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.arguments}}]}]
