"""A multi-turn conversation over the engine, as `lmd chat` and `lmd gradio` hold one per user.

Every turn sends the whole message history, rendered by the workspace's chat template. The engine keeps no state
between requests; what makes later turns cheap is its prefix cache: the previous turn's prompt and reply are still in
cached KV blocks, and the new prompt starts with the same tokens whenever the reply text re-tokenizes to the tokens
that were generated (it does for ordinary text), so only the new user message and the reply are computed.

A reply that is stopped part-way stays in the history as far as it got (it is what the user saw); a reply stopped
before its first character drops the user message too, so the history always alternates user / assistant.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

from lmd.errors import LmdError
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.request_stream import Delta, Response

if TYPE_CHECKING:
    from lmd.chat_templates import Message
    from lmd.turbomind.engine import Engine

_SESSION_IDS = itertools.count()


class ConversationTooLong(LmdError):
    """The history plus the new message no longer fits the engine's session length."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(
            f"the conversation is {tokens} tokens with this message, over the {limit} this session holds "
            "(session_len / KV cache); type `reset` to start a new one"
        )
        self.tokens, self.limit = tokens, limit


class ChatSession:
    def __init__(self, engine: Engine, gen_config: GenerationConfig | None = None, system: str | None = None) -> None:
        self.engine = engine
        self.gen_config = gen_config or GenerationConfig()
        self.system = system
        self.last: Response | None = None  # the latest finished turn (usage, finish_reason)
        self._name = f"chat-{os.getpid()}-{next(_SESSION_IDS)}"
        self._turns = itertools.count()
        self._messages: list[Message] = self._initial_messages()
        self._request_id: str | None = None
        self._epoch = 0  # bumped by reset(): a reply still streaming from before must not write the old history back

    @property
    def messages(self) -> list[Message]:
        """The conversation so far (system prompt first when one was given); a copy."""
        return [dict(m) for m in self._messages]

    @property
    def generating(self) -> bool:
        return self._request_id is not None

    @property
    def is_full(self) -> bool:
        """The last reply ran into the session length: the next message cannot fit, only `reset` helps."""
        usage = self.last.usage if self.last is not None else None
        return usage is not None and usage.total_tokens >= self.engine.max_len

    def reset(self) -> None:
        """Start over: stop a reply in flight and forget every turn (the system prompt stays)."""
        self.abort()
        self._epoch += 1
        self._messages = self._initial_messages()
        self.last = None

    def abort(self) -> None:
        """Stop the reply in flight, if any; its stream ends with finish_reason 'abort' (thread-safe)."""
        request_id = self._request_id
        if request_id is not None:
            self.engine.abort(request_id)

    def chat(self, user: str, gen_config: GenerationConfig | None = None) -> Response:
        """One whole turn: the reply to `user`, added to the history."""
        for _ in self.stream(user, gen_config):
            pass
        return self.last  # type: ignore[return-value] - set when the stream ended

    def stream(self, user: str, gen_config: GenerationConfig | None = None) -> Generator[Delta, None, None]:
        """Queue the reply to `user` now and return its deltas; the turn joins the history when the stream ends.

        Raises ConversationTooLong (history kept as it was) when the prompt would not fit; closing the iterator early
        aborts the reply."""
        if self._request_id is not None:
            raise LmdError("a reply is still being generated in this session; stop it or wait for it to end")
        if not user.strip():
            raise LmdError("the message is empty; type some text")
        messages = [*self._messages, {"role": "user", "content": user}]
        token_ids = self.engine.encode(messages)
        if len(token_ids) >= self.engine.max_len:
            raise ConversationTooLong(len(token_ids), self.engine.max_len)
        request_id = f"{self._name}-{next(self._turns)}"
        stream = self.engine.generate(token_ids, gen_config or self.gen_config, request_id)
        self._request_id = request_id
        return self._follow(stream, messages)

    def _follow(self, stream: Iterator[Delta], messages: list[Message]) -> Generator[Delta, None, None]:
        response, epoch = Response(self._request_id), self._epoch
        try:
            for delta in stream:
                response.add(delta)
                yield delta
        finally:
            if response.finish_reason is None:  # the caller stopped reading (Ctrl-C, closed generator)
                self.engine.abort(response.request_id)
                response.finish_reason = "abort"
            self._request_id = None
            if epoch == self._epoch:
                self._record(messages, response)
        if response.finish_reason == "error":
            raise LmdError(
                f"the engine failed while generating ({self.engine.last_error}); the turn was dropped, "
                "try again or `reset`"
            )

    def _record(self, messages: list[Message], response: Response) -> None:
        self.last = response
        if response.finish_reason == "error" or (response.finish_reason == "abort" and not response.text):
            return
        self._messages = [*messages, {"role": "assistant", "content": response.text}]

    def _initial_messages(self) -> list[Message]:
        return [{"role": "system", "content": self.system}] if self.system else []
