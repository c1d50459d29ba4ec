"""Streaming detokenization: one generated token in, the new text out, never half a UTF-8 character.

Byte-level BPE vocabularies split multi-byte characters (emoji, CJK) across tokens, and SentencePiece vocabularies
render a token's leading space differently at the start of a text. Each push therefore decodes a short window that
starts a few tokens back (`_prefix`), so the tokenizer sees the token in context, and emits only the text that the
window adds beyond what was already emitted (`_read`). While the window's text ends in U+FFFD the token completes a
character only together with later tokens, so nothing is emitted and the window grows until the character is whole.

Windows are decoded by the Rust `tokenizers` backend directly when the tokenizer has one and does no clean-up of
spaces (transformers' own `decode` then returns exactly the backend's text): the Python wrapper around it cost more
than the decoding (two decodes per generated token).
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._backend_decode = backend_decoder(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        # The tail of the prompt gives the first generated tokens their context; it is never emitted.
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._num_context = len(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta returned by push and flush)."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """The generated token ids pushed so far."""
        return self._ids[self._num_context :]

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of a request: emit what is still held back, even if it does not decode to whole characters."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        emitted = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        if window.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        start = _common_prefix_length(emitted, window)
        delta = window[start:]
        self._prefix = self._read
        self._read = len(self._ids)
        self._text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def backend_decoder(tokenizer):
    """The `tokenizers` backend's decode when transformers' decode adds nothing to it (no space clean-up), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend.decode


def _common_prefix_length(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
