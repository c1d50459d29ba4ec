"""Structured outputs: a request's grammar (JSON schema, regex, choices, EBNF) as a token bitmask per decode step.

Three objects, as vLLM and SGLang split them over xgrammar:
  GuidedSpec       what the request asked for; plain, hashable data (the compile cache's key).
  GrammarCompiler  one per engine: the tokenizer's vocabulary as xgrammar sees it, and an LRU of compiled grammars.
  GuidedMatcher    one per request (fork it for each of n choices): the grammar's state after the tokens so far.

Per step, for the guided rows of a batch: `matcher.fill_next_token_bitmask(bitmask, row)` on the CPU, then
`apply_bitmask(logits, bitmask, rows)` (pure torch, any device) before temperature / top-k / top-p; after sampling,
`matcher.accept(token)`. Once the grammar is complete and cannot continue, the only allowed tokens are the stop tokens
(the compiler's eos ids plus the request's extra stop ids); accepting one terminates the matcher.

Bitmask layout (xgrammar's): int32 words, row r, token t allowed <=> bit (t % 32) of word [r, t // 32] is 1.

xgrammar is imported inside the functions that need it: lmd imports and serves unguided requests without it.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from lmd.errors import LmdError
from lmd.turbomind.guided_utf8 import LeadState, SurrogateGuard
from lmd.turbomind.kernels.host_copy import to_device

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

GuidedKind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag"]
GUIDED_KINDS: tuple[str, ...] = get_args(GuidedKind)
MAX_CACHED_GRAMMARS = 256
MAX_REASON = 200  # xgrammar's parse errors may quote the whole schema back

# xgrammar's C++ errors start with "[12:34:56] /project/cpp/file.cc:94: " (and checks with "Check failed: ... : ").
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class InvalidGuide(LmdError):
    """A schema / regex / grammar / choice list that does not compile; `reason` is xgrammar's, one line."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"the {kind} is invalid: {reason}")
        self.kind, self.reason = kind, reason


@dataclass(frozen=True)
class GuidedSpec:
    """`value`: the schema as a JSON string, the regex, the EBNF (root rule `root`), the choices as a JSON list of
    strings, xgrammar's structural tag as JSON (`{"type": "structural_tag", "format": ...}`: how tool calls are
    forced), or "" for json_object (any JSON object)."""

    kind: GuidedKind
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise LmdError(f"GuidedSpec.kind={self.kind!r} is invalid; use one of {', '.join(GUIDED_KINDS)}")
        if not isinstance(self.value, str):
            raise LmdError(f"GuidedSpec.value must be a string, got {type(self.value).__name__}")

    @classmethod
    def from_json_schema(cls, schema: dict[str, Any] | bool | str) -> GuidedSpec:
        """Equal schemas give equal specs. Keys are not sorted: the reply's properties follow the schema's order."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidGuide("json_schema", f"not valid JSON: {exc}") from None
        return cls("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))

    @classmethod
    def from_choices(cls, choices: Sequence[str]) -> GuidedSpec:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def from_structural_tag(cls, tag_format: dict[str, Any]) -> GuidedSpec:
        """`tag_format`: one of xgrammar's structural-tag formats (sequence, or, tag, const_string, grammar, ...)."""
        return cls("structural_tag", json.dumps({"type": "structural_tag", "format": tag_format}, ensure_ascii=False,
                                                separators=(",", ":")))


@dataclass(frozen=True, eq=False)
class CompiledGuide:
    """A compiled grammar bound to one compiler's vocabulary and default stop tokens."""

    spec: GuidedSpec
    grammar: xgrammar.CompiledGrammar
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    allowed: torch.Tensor | None = None  # int32 words ANDed into every mask (JSON: no raw control characters)
    surrogates: SurrogateGuard | None = None  # no encoded surrogates in any reply (guided_utf8)


class GrammarCompiler:
    """`vocab_size`: the width of the model's logits (may exceed len(tokenizer): padded lm_head rows are never
    allowed). `stop_token_ids`: the engine's eos ids (default: the tokenizer's eos). xgrammar is first imported, and
    the vocabulary read (~0.3 s for 49k tokens), by the first compile, so an engine can build one unconditionally."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Iterable[int] = (),
                 max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        stops = tuple(dict.fromkeys(stop_token_ids)) or (tokenizer.eos_token_id,)
        stops = tuple(t for t in stops if t is not None and 0 <= t < vocab_size)
        if not stops:
            raise LmdError("GrammarCompiler: no stop token id inside the vocabulary; pass the engine's eos ids")
        self.vocab_size, self.stop_token_ids = vocab_size, stops
        self._tokenizer, self._max_cached = tokenizer, max_cached
        self._lock = threading.Lock()
        self._cache: OrderedDict[GuidedSpec, Future[CompiledGuide]] = OrderedDict()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._surrogates: SurrogateGuard | None = None
        self._allowed_json: torch.Tensor | None = None

    def compile(self, spec: GuidedSpec) -> CompiledGuide:
        """Compiled once per spec; concurrent callers of one spec wait for the first one's compile. An invalid
        schema / regex / grammar raises LmdError (and is not cached)."""
        with self._lock:
            future = self._cache.get(spec)
            owner = future is None
            if future is None:
                future = self._cache[spec] = Future()
                while len(self._cache) > self._max_cached:
                    self._cache.popitem(last=False)  # a waiter of an evicted entry still holds its future
            else:
                self._cache.move_to_end(spec)
        if owner:
            try:
                allowed = self._no_control_characters() if spec.kind in ("json_object", "json_schema") else None
                grammar = self._compile(spec)
                future.set_result(CompiledGuide(spec, grammar, self.vocab_size, self.stop_token_ids, allowed,
                                                self._surrogates))
            except BaseException as exc:
                with self._lock:
                    if self._cache.get(spec) is future:
                        del self._cache[spec]
                future.set_exception(exc)
        return future.result()

    def matcher(self, spec: GuidedSpec, extra_stop_token_ids: Iterable[int] = ()) -> GuidedMatcher:
        return GuidedMatcher(self.compile(spec), extra_stop_token_ids)

    def _compile(self, spec: GuidedSpec) -> xgrammar.CompiledGrammar:
        compiler = self._xgr_compiler()
        try:
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "json_schema":
                # One layout (", " and ": ", no newlines) rather than any whitespace: small models given free
                # whitespace tend to emit it until max_tokens (vLLM's --disable-any-whitespace exists for that).
                return compiler.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.value))
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.value)
            return compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidGuide(spec.kind, _reason(exc)) from None

    def _no_control_characters(self) -> torch.Tensor:
        """The tokens whose text holds no control character (U+0000..U+001F), as bitmask words. xgrammar 0.2.9's JSON
        strings admit raw control characters (byte tokens like "\x00" or "\t"), which strict JSON parsers
        refuse; lmd's JSON layout has no whitespace outside strings, so a JSON reply never needs them."""
        with self._lock:
            if self._allowed_json is None:
                allowed = allocate_bitmask(1, self.vocab_size)[0]
                for index in range(min(len(self._tokenizer), self.vocab_size)):
                    text = self._tokenizer.decode([index])
                    if any(ord(ch) < 32 for ch in text):
                        allowed[index // 32] &= ~_bit(index % 32)
                for token in self.stop_token_ids:  # a stop token ends the reply whatever its text
                    allowed[token // 32] |= _bit(token % 32)
                self._allowed_json = allowed
            return self._allowed_json

    def _xgr_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                info = _tokenizer_info(xgr, self._tokenizer, self.vocab_size, self.stop_token_ids)
                self._surrogates = SurrogateGuard(info.decoded_vocab, bitmask_words(self.vocab_size))
                # lmd's own LRU is the cache (bounded, keyed by spec); xgrammar's would grow without limit.
                self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1),
                                                     cache_enabled=False)
            return self._compiler


class GuidedMatcher:
    """The grammar state of one request. `extra_stop_token_ids` (e.g. the request's stop_token_ids) end the reply
    too, once the grammar is complete."""

    def __init__(self, compiled: CompiledGuide, extra_stop_token_ids: Iterable[int] = (), *,
                 _matcher: xgrammar.GrammarMatcher | None = None) -> None:
        self.compiled = compiled
        stops = dict.fromkeys((*compiled.stop_token_ids, *extra_stop_token_ids))
        self.stop_token_ids = tuple(t for t in stops if 0 <= t < compiled.vocab_size)
        if _matcher is None:
            xgr = import_xgrammar()
            _matcher = xgr.GrammarMatcher(compiled.grammar, override_stop_tokens=list(self.stop_token_ids))
        self._matcher = _matcher
        self._lead = LeadState()
        # xgrammar refuses every token once its stop token is accepted; lmd keeps allowing (and counting, for
        # rollback) the stop tokens, so a request that does not end at one (ignore_eos) never meets an empty mask.
        self._after_stop = 0

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Writes the allowed next tokens into `bitmask[row]` (CPU int32, allocate_bitmask's layout). Returns False
        when every token is allowed (the row needs no masking)."""
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
            raise LmdError(f"GuidedMatcher: the bitmask must be a 2-D int32 CPU tensor, got {bitmask.dtype} "
                           f"{tuple(bitmask.shape)} on {bitmask.device}; use allocate_bitmask")
        if bitmask.shape[1] != bitmask_words(self.compiled.vocab_size):
            raise LmdError(f"GuidedMatcher: bitmask rows of {bitmask.shape[1]} words do not cover the vocabulary of "
                           f"{self.compiled.vocab_size}; allocate_bitmask(rows, {self.compiled.vocab_size})")
        if self._matcher.is_terminated():
            bitmask[row] = 0
            for token in self.stop_token_ids:
                bitmask[row, token // 32] |= _bit(token % 32)
            return True
        masked = self._matcher.fill_next_token_bitmask(bitmask, row)
        allowed, surrogates = self.compiled.allowed, self.compiled.surrogates
        if allowed is None and surrogates is None:
            return masked
        stops = [t for t in self.stop_token_ids if bitmask[row, t // 32] & _bit(t % 32)]
        if allowed is not None:
            bitmask[row] &= allowed
        if surrogates is not None:
            surrogates.apply(bitmask[row], self._lead.after_lead)
        for token in stops:  # a stop token the grammar allows stays allowed, whatever its text
            bitmask[row, token // 32] |= _bit(token % 32)
        return True

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False (state unchanged) when the grammar does not allow it."""
        if self._matcher.is_terminated():
            if token_id in self.stop_token_ids:
                self._after_stop += 1
                return True
            return False
        accepted = self._matcher.accept_token(token_id)
        if accepted and self.compiled.surrogates is not None:
            self._lead.accept(self.compiled.surrogates, token_id)
        return accepted

    def is_terminated(self) -> bool:
        """True once a stop token is accepted after a complete reply."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the tokens so far form a complete reply (a stop token may come next)."""
        return self._matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (speculative decoding's rejected drafts)."""
        undone = min(num_tokens, self._after_stop)
        self._after_stop -= undone
        if num_tokens > undone:
            self._matcher.rollback(num_tokens - undone)
            self._lead.rollback(num_tokens - undone)

    def fork(self) -> GuidedMatcher:
        """An independent copy of this state (one per choice when a request samples n)."""
        forked = GuidedMatcher(self.compiled, self.stop_token_ids, _matcher=self._matcher.fork())
        forked._after_stop, forked._lead = self._after_stop, self._lead.fork()
        return forked


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask with every token allowed (xgrammar fills it in place; it only writes CPU tensors)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | None = None) -> None:
    """logits[r, t] = -inf where bit t of bitmask[r] is 0, for each r in `row_indices` (rows of both tensors, as
    xgrammar's `indices`, on the bitmask's device; None: every row, in place without a gather); other rows untouched.
    Logits on any device; a CPU bitmask goes over through pinned memory, without waiting for the GPU."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise LmdError(f"apply_bitmask: logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} must be 2-D "
                       "with one bitmask row per logits row")
    vocab = logits.shape[1]
    if bitmask.shape[1] != bitmask_words(vocab):
        raise LmdError(f"apply_bitmask: bitmask rows of {bitmask.shape[1]} words do not match {vocab} logits")
    if row_indices is not None and row_indices.numel() == 0:
        return
    words = bitmask if row_indices is None else bitmask.index_select(0, row_indices.to(bitmask.device))
    words = to_device(words, torch.int32, logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    banned = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :vocab] == 0
    if row_indices is None:
        logits.masked_fill_(banned, float("-inf"))
        return
    index = to_device(row_indices, torch.int64, logits.device)
    logits[index] = logits[index].masked_fill_(banned, float("-inf"))


def choice_grammar(choices_json: str) -> str:
    """EBNF matching exactly one of the choices (a JSON list of non-empty strings)."""
    try:
        choices = json.loads(choices_json)
    except json.JSONDecodeError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidGuide("choice", f"the choices must be a non-empty list of non-empty strings, got "
                                     f"{choices_json[:80]}")
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in dict.fromkeys(choices))


def json_schema_ebnf(schema: dict[str, Any] | bool) -> str:
    """The EBNF of a JSON schema, laid out as the json_schema kind lays it out (no free whitespace, strict): the
    content of a structural tag's `grammar` format, whose own `json_schema` format always allows free whitespace."""
    xgr = import_xgrammar()
    try:
        return str(xgr.Grammar.from_json_schema(json.dumps(schema, ensure_ascii=False), any_whitespace=False))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidGuide("json_schema", _reason(exc)) from None


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise LmdError("structured outputs (response_format json_object / json_schema, guided_*) need xgrammar: "
                       "pip install xgrammar") from None
    return xgrammar


def _ebnf_literal(text: str) -> str:
    escaped = []
    for ch in text:
        if ch in '"\\':
            escaped.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            escaped.append(f"\\u{ord(ch):04x}")  # \x would read on into a following hex digit
        else:
            escaped.append(ch)
    return '"' + "".join(escaped) + '"'


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return (_XGR_PREFIX.sub("", text).splitlines()[0] if text else type(exc).__name__)[:MAX_REASON]


def _bit(index: int) -> int:
    """Bit `index` of an int32 word as a Python int torch accepts (bit 31 is the sign bit)."""
    return -(1 << 31) if index == 31 else 1 << index


def _tokenizer_info(xgr: Any, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                    stop_token_ids: tuple[int, ...]) -> xgrammar.TokenizerInfo:
    """xgrammar's view of the vocabulary, with the tokenizer's special tokens (<|im_start|>, <repo_name>, ...) made
    empty: xgrammar treats empty tokens as special and never allows them, where it would otherwise allow their
    literal text inside a JSON string (text that skip_special_tokens then drops from the reply)."""
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
    vocab: list[str] = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size:
            vocab[index] = token
    special = set(tokenizer.all_special_ids)
    special.update(i for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items() if added.special)
    for index in special:
        if 0 <= index < vocab_size:
            vocab[index] = ""
    return xgr.TokenizerInfo(vocab, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids),
                             add_prefix_space=detected.add_prefix_space)
