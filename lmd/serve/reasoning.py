"""Model text -> (reasoning, content), incrementally: `lmd serve --reasoning-parser` (vLLM's and SGLang's flag).

Thinking models write their reasoning between `<think>` and `</think>`, then the answer. The reasoning goes to the
message's `reasoning_content` (streamed as `delta.reasoning_content`), the rest to `content` (and on to the tool-call
parser). Where the reply starts decides the state: inside the reasoning when the rendered prompt ends in an open
`<think>` (DeepSeek-R1's and Qwen3-Thinking's templates write it), else the reply is reasoning only if it opens with
`<think>` (Qwen3's hybrid mode; with `enable_thinking: false` its template closes the block in the prompt, and the
reply is all content). A reply that ends inside the reasoning (max_tokens) leaves it reasoning, content empty. A
reply under a grammar (structured outputs, a forced tool call) starts outside: the grammar allows no reasoning.

One parser serves streaming and whole replies alike, so a stream adds up to the non-streamed answer exactly. Text
that may be the start of a tag is held until it cannot be; whitespace around the reasoning and before the answer is
dropped (held until it is known which side of a tag it falls on); a reply without reasoning is left as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS: dict[str, tuple[str, str]] = {  # name -> (start tag, end tag)
    "deepseek_r1": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
}


@dataclass(frozen=True)
class Reasoning:
    text: str


def starts_in_reasoning(prompt_text: str, parser: str) -> bool:
    """Whether a reply to `prompt_text` begins inside the reasoning (the prompt ends in an open start tag)."""
    return prompt_text.rstrip().endswith(REASONING_PARSERS[parser][0])


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may still become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    _BEGIN, _REASONING, _AFTER, _CONTENT = range(4)

    def __init__(self, parser: str, in_reasoning: bool = False) -> None:
        """`in_reasoning`: the prompt opened the reasoning (a start tag the reply repeats anyway is dropped)."""
        self.start, self.end = REASONING_PARSERS[parser]
        self._inside = in_reasoning
        self._state = self._BEGIN
        self._held = ""
        self._reasoning_started = False  # leading whitespace of the reasoning is dropped until its first text

    def feed(self, text: str) -> list[str | Reasoning]:
        """The pieces of `text` that can be told apart now: reasoning, and content (plain strings)."""
        self._held += text
        out: list[str | Reasoning] = []
        while True:
            state, held = self._state, self._held
            if state == self._CONTENT:
                self._held = ""
                if held:
                    out.append(held)
                return out
            if state == self._BEGIN:
                stripped = held.lstrip()
                if stripped.startswith(self.start):
                    self._state, self._held = self._REASONING, stripped[len(self.start):]
                    continue
                if not stripped or self.start.startswith(stripped):
                    return out  # whitespace, or a partial start tag: not yet known
                # no start tag: inside the reasoning the prompt opened, else content exactly as written
                self._state = self._REASONING if self._inside else self._CONTENT
                continue
            if state == self._AFTER:
                stripped = held.lstrip()
                self._held = stripped
                if not stripped:
                    return out
                self._state = self._CONTENT
                continue
            # inside the reasoning
            at = held.find(self.end)
            if at >= 0:
                self._emit_reasoning(out, held[:at].rstrip())
                self._state, self._held = self._AFTER, held[at + len(self.end):]
                continue
            keep = _held_prefix(held, self.end)
            body, tail = held[: len(held) - keep], held[len(held) - keep:]
            visible = body.rstrip()  # trailing whitespace waits: it is dropped if the end tag follows
            self._held = body[len(visible):] + tail
            self._emit_reasoning(out, visible)
            return out

    def finish(self) -> list[str | Reasoning]:
        """What is still held once the reply has ended."""
        held, self._held = self._held, ""
        if self._state == self._REASONING or (self._state == self._BEGIN and self._inside):
            out: list[str | Reasoning] = []
            self._emit_reasoning(out, held.rstrip())
            return out
        if self._state == self._AFTER or not held:
            return []
        return [held]  # BEGIN (whitespace or a partial tag that never completed) or content

    def _emit_reasoning(self, out: list[str | Reasoning], text: str) -> None:
        if not self._reasoning_started:
            text = text.lstrip()
        if text:
            self._reasoning_started = True
            out.append(Reasoning(text))
