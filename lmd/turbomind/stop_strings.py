"""Stop strings over a stream of text deltas: the stop word may span deltas and is never emitted.

The matcher holds back the longest tail of the text that could still grow into a stop word, so a client never sees
text that later turns out to be (the start of) a stop word. Held text is released as soon as it can no longer start
one, or by `flush()` when the request ends for another reason.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop_words: Sequence[str]) -> None:
        self._words = tuple(w for w in stop_words if w)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop word has appeared); after a stop every push returns ("", True)."""
        if self._stopped:
            return "", True
        text = self._held + delta
        end = _earliest_match(text, self._words)
        if end is not None:
            self._held = ""
            self._stopped = True
            return text[:end], True
        keep = _longest_partial_suffix(text, self._words)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, at the end of a request that did not stop on a stop word ("" after a stop)."""
        held, self._held = self._held, ""
        return held


def _earliest_match(text: str, words: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(w) for w in words) if i >= 0]
    return min(found) if found else None


def _longest_partial_suffix(text: str, words: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop word."""
    best = 0
    for word in words:
        for n in range(min(len(word) - 1, len(text)), best, -1):
            if text.endswith(word[:n]):
                best = n
                break
    return best
