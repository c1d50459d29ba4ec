"""The read-reply loop of `lmd chat`: one line in per turn, the reply streamed out as it is generated.

Replies go to stdout and everything else (banner, notices) to stderr, so `printf 'Hi\\nexit\\n' | lmd chat ws > out`
leaves only the replies, one per turn, in `out`. The `>>>` prompt and line editing appear only on a terminal.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from lmd.chat.session import ChatSession, ConversationTooLong
from lmd.errors import LmdError

EXIT_COMMANDS = ("exit", "quit")
RESET_COMMANDS = ("reset", "new")
BANNER = "`exit` or `quit` leaves, `reset` or `new` starts a new conversation, Ctrl-C stops a reply"


@dataclass(frozen=True)
class TerminalIO:
    read_line: Callable[[str], str]  # raises EOFError when input ends
    replies: TextIO
    notes: TextIO
    prompt: str


def terminal_io() -> TerminalIO:
    """The process's stdin/stdout/stderr; on a terminal with a prompt and readline editing."""
    if sys.stdin.isatty():
        import readline  # noqa: F401 - importing it gives input() history and line editing

        return TerminalIO(input, sys.stdout, sys.stderr, ">>> ")
    return TerminalIO(_read_piped_line, sys.stdout, sys.stderr, "")


def _read_piped_line(prompt: str) -> str:
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def run_chat_loop(session: ChatSession, io: TerminalIO, title: str = "lmd chat") -> int:
    """Chat until exit/quit, end of input or Ctrl-C at the prompt; the number of replies given."""
    print(f"{title} — {BANNER}", file=io.notes)
    replies = 0
    while True:
        try:
            line = io.read_line(io.prompt).strip()
        except (EOFError, KeyboardInterrupt):
            if io.prompt:
                print(file=io.notes)
            return replies
        command = line.lower()
        if not line:
            continue
        if command in EXIT_COMMANDS:
            return replies
        if command in RESET_COMMANDS:
            session.reset()
            print("(new conversation)", file=io.notes)
            continue
        replies += _reply(session, line, io)


def _reply(session: ChatSession, line: str, io: TerminalIO) -> int:
    """Stream one reply; 1 when a reply (even a stopped one) was printed."""
    try:
        deltas = session.stream(line)
    except ConversationTooLong as exc:
        print(f"lmd: {exc}", file=io.notes)
        return 0
    try:
        for delta in deltas:
            io.replies.write(delta.text)
            io.replies.flush()
    except KeyboardInterrupt:
        deltas.close()  # aborts the request in the engine and keeps the partial reply in the history
        io.replies.write("\n")
        print("(reply stopped)", file=io.notes)
        return 1
    except LmdError as exc:
        io.replies.write("\n")
        print(f"lmd: {exc}", file=io.notes)
        return 0
    io.replies.write("\n")
    io.replies.flush()
    if session.is_full:
        print(
            f"lmd: the conversation filled this session's {session.engine.max_len} tokens (session_len); "
            "type `reset` to start a new one",
            file=io.notes,
        )
    return 1
