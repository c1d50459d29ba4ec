"""Per-request generation settings (LMDeploy's `GenerationConfig` vocabulary), validated once at construction.

Greedy decoding is `temperature=0` or `top_k=1`; every other setting samples. Runtime facts that belong to the
model rather than to the request (eos ids, vocabulary size) are not stored here: the engine passes them to the
sampler beside the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmd.errors import LmdError

if TYPE_CHECKING:
    from lmd.turbomind.guided import GuidedSpec

MAX_LOGPROBS = 64
MAX_SAMPLES = 128  # n and best_of
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


def _fail(field: str, value: object, valid: str) -> LmdError:
    return LmdError(f"GenerationConfig.{field}={value!r} is invalid; use {valid}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    temperature: float = 0.8
    top_k: int = 40  # 0 disables top-k
    top_p: float = 0.8  # 1.0 disables top-p
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI: minus this from the logit of every token generated at least once
    frequency_penalty: float = 0.0  # OpenAI: minus this times the number of times a token was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); a dict is accepted
    min_p: float = 0.0  # keep tokens whose probability is at least min_p times the top one's (after temperature)
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop_words: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; 0: the chosen token only; k: also the k most likely alternatives
    # The prompt's tokens with their logprobs (the first has none), computed in the prefill; same meaning of k. Such a
    # request computes its whole prompt: it takes nothing from the prefix cache (whose blocks carry no logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Parallel sampling: n samples of one prompt (Engine.generate_samples) from one prefill, forked sequences sharing
    # the prompt's KV; best_of >= n samples of which the caller keeps the n with the highest cumulative logprob.
    n: int = 1
    best_of: int | None = None
    # Structured output: the reply follows this grammar and ends (finish "stop") as soon as the grammar is complete.
    guided: GuidedSpec | None = None
    # Beam search (beam_width > 1; transformers' `generate(num_beams=...)` rules): the n best of beam_width beams,
    # scored by cumulative logprob / generated_length ** length_penalty. early_stopping: False (stop when no running
    # beam can beat the finished ones at its present length), True (stop once beam_width beams finished) or "never"
    # (with length_penalty > 0, judge a running beam at max_new_tokens).
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; the frozen config stores tuples so it stays hashable.
        object.__setattr__(self, "stop_token_ids", self._tuple_of("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "stop_words", self._tuple_of("stop_words", self.stop_words))
        object.__setattr__(self, "logit_bias", self._bias_pairs(self.logit_bias))
        self._validate()

    @staticmethod
    def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
        if value is None:
            return ()
        try:
            pairs = tuple(value.items()) if isinstance(value, dict) else tuple(tuple(p) for p in value)  # type: ignore[union-attr]
        except TypeError:
            raise _fail("logit_bias", value, "a mapping of token id -> bias") from None
        if not all(len(p) == 2 and _is_int(p[0]) and p[0] >= 0 and _is_number(p[1])
                   and -MAX_LOGIT_BIAS <= p[1] <= MAX_LOGIT_BIAS for p in pairs):
            raise _fail("logit_bias", value, f"token ids >= 0 mapped to biases in [-{MAX_LOGIT_BIAS:g}, "
                                             f"{MAX_LOGIT_BIAS:g}]")
        return tuple(sorted((int(t), float(b)) for t, b in pairs))

    @staticmethod
    def _tuple_of(field: str, value: object) -> tuple:
        if value is None:
            return ()
        if isinstance(value, (str, int)):
            value = (value,)
        try:
            return tuple(value)
        except TypeError:
            raise _fail(field, value, "a list or tuple") from None

    def _validate(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise _fail("max_new_tokens", self.max_new_tokens, "an integer >= 1")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise _fail("min_new_tokens", self.min_new_tokens, f"an integer in [0, max_new_tokens={self.max_new_tokens}]")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise _fail("temperature", self.temperature, f"a number in [0, {MAX_TEMPERATURE}] (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _fail("top_k", self.top_k, "an integer >= 0 (0 = off, 1 = greedy)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _fail("top_p", self.top_p, "a number in (0, 1] (1 = off)")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise _fail("repetition_penalty", self.repetition_penalty, "a number > 0 (1 = off, > 1 discourages repeats)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise _fail(name, value, f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off)")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _fail("min_p", self.min_p, "a number in [0, 1] (0 = off)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise _fail("seed", self.seed, "None or an integer in [0, 2**63)")
        if not isinstance(self.ignore_eos, bool):
            raise _fail("ignore_eos", self.ignore_eos, "True or False")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise _fail("stop_token_ids", self.stop_token_ids, "non-negative integer token ids")
        if not all(isinstance(w, str) and w for w in self.stop_words):
            raise _fail("stop_words", self.stop_words, "non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise _fail(name, value, f"None (off) or an integer in [0, {MAX_LOGPROBS}]")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
            raise _fail("n", self.n, f"an integer in [1, {MAX_SAMPLES}]")
        if self.best_of is not None and (not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_SAMPLES):
            raise _fail("best_of", self.best_of, f"None or an integer in [n={self.n}, {MAX_SAMPLES}]")
        if not isinstance(self.skip_special_tokens, bool):
            raise _fail("skip_special_tokens", self.skip_special_tokens, "True or False")
        if self.guided is not None:
            self._validate_guided()
        self._validate_beams()

    def _validate_beams(self) -> None:
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_SAMPLES:
            raise _fail("beam_width", self.beam_width, f"an integer in [1, {MAX_SAMPLES}] (1 = no beam search)")
        if not _is_number(self.length_penalty):
            raise _fail("length_penalty", self.length_penalty, "a number (1 = score per token, 0 = no length term)")
        if self.early_stopping not in (False, True, "never"):
            raise _fail("early_stopping", self.early_stopping, 'False, True or "never"')
        if self.beam_width == 1:
            return
        if self.n > self.beam_width or self.best_of is not None:
            raise _fail("n", self.n, f"at most beam_width={self.beam_width} beams returned, best_of unset (the beam "
                                     "width is how many candidates are kept)")
        if not self.is_greedy:
            raise _fail("temperature", self.temperature, "0 with beam search: it keeps the most likely beams, it "
                                                          "does not sample")
        refused = {"min_new_tokens": self.min_new_tokens != 0, "repetition_penalty": self.repetition_penalty != 1.0,
                   "presence_penalty": self.presence_penalty != 0.0, "frequency_penalty": self.frequency_penalty != 0.0,
                   "logit_bias": bool(self.logit_bias), "min_p": self.min_p != 0.0, "stop_words": bool(self.stop_words),
                   "logprobs": self.logprobs is not None, "prompt_logprobs": self.prompt_logprobs is not None,
                   "guided": self.guided is not None}
        name = next((name for name, set_ in refused.items() if set_), None)
        if name is not None:
            raise _fail(name, getattr(self, name), "its default with beam search (beam_width > 1), which scores "
                                                   "beams by their plain logprobs")

    def _validate_guided(self) -> None:
        from lmd.turbomind.guided import GuidedSpec  # imports torch: only for guided configs

        if not isinstance(self.guided, GuidedSpec):
            raise _fail("guided", self.guided, "None or a GuidedSpec (lmd.turbomind.guided)")
        # The grammar decides where the reply ends: once complete it allows only stop tokens, which min_new_tokens
        # would forbid, leaving no token at all.
        if self.min_new_tokens:
            raise _fail("min_new_tokens", self.min_new_tokens, "0 with a structured output (guided): the grammar "
                                                               "decides where the reply ends")

    @property
    def num_samples(self) -> int:
        """Sequences generated: best_of when set, else n."""
        return self.n if self.best_of is None else self.best_of

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids this config names must exist in the model's vocabulary (checked at admission)."""
        outside = next((t for t, _ in self.logit_bias if t >= vocab_size), None)
        if outside is not None:
            raise _fail("logit_bias", dict(self.logit_bias),
                        f"token ids in [0, {vocab_size}) (id {outside} is outside the vocabulary)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
