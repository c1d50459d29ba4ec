"""What the `lmd gradio` page does on each event, as plain functions of plain values (no gradio import).

Each browser session owns one ChatSession (a gradio State); the chatbot shows that session's history, so what the
page shows and what the model is sent never drift apart. `respond` streams; `stop` runs as a separate event while
`respond` is still streaming and aborts the engine request, after which `respond` ends by itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from lmd.chat.session import ChatSession, ConversationTooLong
from lmd.engine_options import with_sampling
from lmd.errors import LmdError
from lmd.turbomind.request_stream import Response

if TYPE_CHECKING:
    from lmd.turbomind.engine import Engine
    from lmd.turbomind.gen_config import GenerationConfig

ChatMessages = list[dict[str, str]]
Update = tuple[ChatMessages, ChatSession, str, str]  # chatbot, session state, textbox, status line
GENERATING = "generating…"


class ChatEvents:
    def __init__(self, engine: Engine, gen_config: GenerationConfig, system: str | None = None) -> None:
        self.engine, self.gen_config, self.system = engine, gen_config, system

    def new_session(self) -> ChatSession:
        return ChatSession(self.engine, self.gen_config, self.system)

    def respond(
        self, message: str, session: ChatSession | None, temperature: float, top_p: float, max_new_tokens: float
    ) -> Iterator[Update]:
        """Stream the reply to `message`: one update as soon as the request is queued, then one per text delta."""
        session = session or self.new_session()
        shown = chat_messages(session)
        try:
            config = with_sampling(
                session.gen_config, temperature=float(temperature), top_p=float(top_p), max_new_tokens=int(max_new_tokens)
            )
            deltas = session.stream(message, config)
        except ConversationTooLong as exc:
            yield (
                shown,
                session,
                message,
                (
                    f"The conversation is {exc.tokens} tokens with this message, over the "
                    f"{exc.limit} this session holds; press Reset to start a new one."
                ),
            )
            return
        except LmdError as exc:
            yield shown, session, message, str(exc)
            return
        pending = [*shown, {"role": "user", "content": message}]
        reply = ""
        yield [*pending, {"role": "assistant", "content": reply}], session, "", GENERATING
        try:
            for delta in deltas:
                if delta.text:
                    reply += delta.text
                    yield [*pending, {"role": "assistant", "content": reply}], session, "", GENERATING
        except LmdError as exc:
            yield chat_messages(session), session, message, str(exc)
            return
        yield chat_messages(session), session, "", turn_status(session.last)

    def stop(self, session: ChatSession | None) -> None:
        if session is not None:
            session.abort()

    def reset(self, session: ChatSession | None) -> tuple[ChatMessages, ChatSession, str]:
        """An empty conversation (a reply in flight is aborted)."""
        if session is None:
            return [], self.new_session(), ""
        session.reset()
        return [], session, ""


def chat_messages(session: ChatSession) -> ChatMessages:
    """The history as the chatbot shows it: user and assistant turns (the system prompt stays hidden)."""
    return [m for m in session.messages if m["role"] != "system"]


def turn_status(response: Response | None) -> str:
    if response is None or response.usage is None:
        return "stopped" if response is not None else ""
    usage = response.usage
    ending = {"stop": "", "length": " (length limit)", "abort": " (stopped)"}.get(response.finish_reason or "", "")
    return (
        f"{usage.completion_tokens} tokens generated{ending}; prompt {usage.prompt_tokens} tokens, "
        f"{usage.cached_tokens} of them from the prefix cache"
    )
