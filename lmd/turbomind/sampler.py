"""Turns one step's last-position logits into the next token of every running sequence.

Order of operations per row (vLLM / LMDeploy / HF order):
  1. repetition penalty over every token already in the sequence (prompt + generated), HF semantics;
  2. presence and frequency penalties over the generated tokens (OpenAI's definitions, as vLLM applies them:
     logit -= frequency_penalty * count + presence_penalty * (count > 0)), then logit_bias added;
  3. while fewer than `min_new_tokens` are generated, the row's eos ids and stop token ids are masked to -inf;
  4. guided rows (a structured output): tokens their grammar does not allow next are masked to -inf, from one
     bitmask for the batch's guided rows, filled on the host by each row's matcher (already advanced past every
     accepted token: the rows are built after the previous step is resolved) and queued to the device; a complete
     grammar allows only the stop tokens. Guided configs have min_new_tokens = 0, so 3 and 4 never meet;
  5. greedy rows (`temperature == 0` or `top_k == 1`) take the argmax;
  6. sampled rows: divide by temperature, keep the top-k logits (ties with the k-th kept, as HF's TopKLogitsWarper)
     and those whose probability is at least min_p times the top one's, renormalise, keep the smallest prefix of the
     sorted distribution whose mass reaches top_p (the top token always stays), and draw one token by inverse CDF
     with a single uniform number from the row's own generator.

Because each sampled row consumes exactly one number from its own `torch.Generator`, a seeded request yields the same
tokens whatever else shares its batch and wherever it sits in it. Rows without a generator draw from the sampler's
private generator (no global RNG state is read or written).

Logprobs follow vLLM's default (`logprobs_mode="raw_logprobs"`): `log_softmax` of the model's logits as they came out of
the model, before penalty, masking, temperature, top-k and top-p. They therefore describe the model, not the sampling
settings, and a greedy token's logprob is the model's log-probability of it.
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lmd.errors import LmdError
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.kernels.host_copy import to_device, to_host

if TYPE_CHECKING:
    from lmd.turbomind.guided import GuidedMatcher

MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingRow:
    config: GenerationConfig
    token_ids: list[int]  # prompt + generated so far (the repetition-penalty context)
    num_generated: int
    generator: torch.Generator | None
    eos_ids: tuple[int, ...]
    guided: GuidedMatcher | None = None  # the request's grammar state, when it has a structured output


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # None where the row's config has logprobs=None
    top_logprobs: list[list[tuple[int, float]] | None]  # the config.logprobs most likely (token, logprob); None if off


class PendingSample:
    """A batch's sampled ids (and logprobs) as device tensors, on their way to the host.

    The copies to pinned host memory are queued when the sample is made; `result()` waits for them only. Until
    then `token_ids_device` can feed the next step's input on the device (overlap)."""

    def __init__(self, token_ids: torch.Tensor, rows: list[SamplingRow], wanted: list[int] | None = None,
                 picked: torch.Tensor | None = None, top_values: torch.Tensor | None = None,
                 top_ids: torch.Tensor | None = None) -> None:
        self.token_ids_device = token_ids
        self._rows, self._wanted = rows, wanted or []
        tensors = [token_ids] + ([picked, top_values, top_ids] if self._wanted else [])
        self._host = to_host(tensors)  # type: ignore[arg-type]
        self._event: torch.cuda.Event | None = None
        if token_ids.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._result: SampleOutput | None = None

    def result(self) -> SampleOutput:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = self._convert()
        return self._result

    def _convert(self) -> SampleOutput:
        rows = self._rows
        token_ids = self._host[0].tolist()
        logprobs: list[float | None] = [None] * len(rows)
        top_logprobs: list[list[tuple[int, float]] | None] = [None] * len(rows)
        if self._wanted:
            picked, top_values, top_ids = (t.tolist() for t in self._host[1:])
            for slot, i in enumerate(self._wanted):
                n = rows[i].config.logprobs
                logprobs[i] = picked[slot]
                top_logprobs[i] = list(zip(top_ids[slot][:n], top_values[slot][:n], strict=True))
        return SampleOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top_logprobs)


def request_generator(config: GenerationConfig, device: torch.device | str = "cpu",
                      offset: int = 0) -> torch.Generator | None:
    """The per-request generator for a seeded config (None when unseeded): create it once, at admission.
    `offset`: the sample's index under parallel sampling (seed + offset, wrapped to the seed range)."""
    if config.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed((config.seed + offset) % 2**63)
    return generator


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
        return self.launch(logits, rows).result()

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow]) -> PendingSample:
        """Queue the batch's sampling on the logits' device; nothing here waits for the GPU."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise LmdError(f"Sampler.sample: logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
        raw = logits.float()
        return pending_sample(raw, self.choose(raw, rows), rows)

    def choose(self, raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The token of every row (fp32 logits in, token ids on their device out)."""
        if all(_plain_greedy(row) for row in rows):  # the common decode batch: one argmax
            return raw.argmax(dim=-1)
        processed = processed_logits(raw, rows)
        device = raw.device
        chosen = torch.empty(len(rows), dtype=torch.long, device=device)
        greedy = [i for i, row in enumerate(rows) if row.config.is_greedy]
        sampled = [i for i, row in enumerate(rows) if not row.config.is_greedy]
        if greedy:
            index = to_device(greedy, torch.int64, device)
            chosen[index] = processed[index].argmax(dim=-1)
        if sampled:
            index = to_device(sampled, torch.int64, device)
            uniforms = self.uniforms([rows[i] for i in sampled], device)
            chosen[index] = _sample_top_k_top_p(processed[index], [rows[i].config for i in sampled], uniforms)
        return chosen

    def uniforms(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """One uniform in [0, 1) per row, each from that row's own generator (CPU or device generators alike)."""
        values: list[float] = []
        on_device: list[tuple[int, torch.Tensor]] = []
        for i, row in enumerate(rows):
            generator = row.generator if row.generator is not None else self._generator
            if generator.device.type == "cpu":
                values.append(torch.rand(1, generator=generator, dtype=torch.float64).item())
            else:
                values.append(0.0)
                on_device.append((i, torch.rand(1, generator=generator, device=generator.device, dtype=torch.float64)))
        uniforms = to_device(values, torch.float64, device)
        for i, value in on_device:
            uniforms[i] = value.to(device)[0]
        return uniforms.unsqueeze(1)


def processed_logits(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Steps 1-4 of the module docstring on a copy of the fp32 logits."""
    processed = raw.clone()
    _apply_repetition_penalty(processed, rows)
    _apply_presence_frequency(processed, rows)
    _apply_logit_bias(processed, rows)
    _mask_early_stop(processed, rows)
    _apply_guided(processed, rows)
    return processed


def sampling_probs(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each row's token is drawn from, over the vocabulary (rows sum to 1): the processed logits
    through temperature, top-k, min-p and top-p, renormalised; a greedy row's is one-hot at its argmax. Speculative
    verification needs it whole (rejection sampling compares it with the proposer's)."""
    processed = processed_logits(raw, rows)
    probs = torch.zeros_like(processed)
    greedy = [i for i, row in enumerate(rows) if row.config.is_greedy]
    sampled = [i for i, row in enumerate(rows) if not row.config.is_greedy]
    device = raw.device
    if greedy:
        index = to_device(greedy, torch.int64, device)
        probs[index] = torch.nn.functional.one_hot(processed[index].argmax(dim=-1), raw.shape[1]).to(probs.dtype)
    if sampled:
        index = to_device(sampled, torch.int64, device)
        kept, sorted_ids = _filtered_sorted_probs(processed[index], [rows[i].config for i in sampled])
        kept = kept / kept.sum(dim=-1, keepdim=True)
        probs[index] = torch.zeros_like(kept).scatter_(1, sorted_ids, kept)
    return probs


def _plain_greedy(row: SamplingRow) -> bool:
    """Greedy with nothing that changes the logits or asks for logprobs: the argmax of the raw logits."""
    config = row.config
    return (config.is_greedy and config.repetition_penalty == 1.0 and config.logprobs is None
            and row.num_generated >= config.min_new_tokens and not _has_openai_penalty(config) and not config.logit_bias
            and row.guided is None)


def _has_openai_penalty(config: GenerationConfig) -> bool:
    return config.presence_penalty != 0.0 or config.frequency_penalty != 0.0


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """HF's RepetitionPenaltyLogitsProcessor: seen tokens' logits are divided by the penalty if > 0, else multiplied."""
    picked = [i for i, row in enumerate(rows) if row.config.repetition_penalty != 1.0 and row.token_ids]
    if not picked:
        return
    device = logits.device
    # array -> frombuffer is several times faster than torch.tensor on long Python lists (a whole context per row).
    flat = array("q", itertools.chain.from_iterable(rows[i].token_ids for i in picked))
    token_index = to_device(torch.frombuffer(flat, dtype=torch.int64), torch.int64, device)
    lengths = torch.tensor([len(rows[i].token_ids) for i in picked])
    row_index = to_device(torch.tensor(picked).repeat_interleave(lengths), torch.int64, device)
    penalty = torch.tensor([rows[i].config.repetition_penalty for i in picked]).repeat_interleave(lengths)
    penalty = to_device(penalty, logits.dtype, device)
    seen = logits[row_index, token_index]
    # A token seen twice is written twice with the same value (computed from the original logit), never penalised twice.
    logits[row_index, token_index] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _apply_presence_frequency(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI's penalties from each row's generated tokens (the prompt does not count), one scatter for the batch."""
    picked = [i for i, row in enumerate(rows) if _has_openai_penalty(row.config) and row.num_generated]
    if not picked:
        return
    device, vocab = logits.device, logits.shape[1]
    generated = [rows[i].token_ids[len(rows[i].token_ids) - rows[i].num_generated:] for i in picked]
    flat = array("q", itertools.chain.from_iterable(generated))
    token_index = to_device(torch.frombuffer(flat, dtype=torch.int64), torch.int64, device)
    lengths = torch.tensor([len(g) for g in generated])
    slot_index = to_device(torch.arange(len(picked)).repeat_interleave(lengths), torch.int64, device)
    counts = torch.zeros(len(picked), vocab, device=device)
    counts.index_put_((slot_index, token_index), torch.ones_like(token_index, dtype=counts.dtype), accumulate=True)
    frequency = to_device([rows[i].config.frequency_penalty for i in picked], counts.dtype, device).unsqueeze(1)
    presence = to_device([rows[i].config.presence_penalty for i in picked], counts.dtype, device).unsqueeze(1)
    index = to_device(picked, torch.int64, device)
    logits[index] -= frequency * counts + presence * (counts > 0).float()


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Each row's logit_bias added to its logits (token ids were checked against the vocabulary at admission)."""
    pairs = [(i, token, bias) for i, row in enumerate(rows) for token, bias in row.config.logit_bias]
    if not pairs:
        return
    device = logits.device
    row_index = to_device([p[0] for p in pairs], torch.int64, device)
    token_index = to_device([p[1] for p in pairs], torch.int64, device)
    bias = to_device([p[2] for p in pairs], logits.dtype, device)
    logits.index_put_((row_index, token_index), bias, accumulate=True)


def _mask_early_stop(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Before `min_new_tokens` tokens exist, no token that would end the request may be chosen."""
    vocab = logits.shape[1]
    pairs = [(i, t) for i, row in enumerate(rows) if row.num_generated < row.config.min_new_tokens
             for t in sorted({t for t in (*row.eos_ids, *row.config.stop_token_ids) if 0 <= t < vocab})]
    if pairs:
        index = to_device([x for pair in pairs for x in pair], torch.int64, logits.device).view(-1, 2)
        logits[index[:, 0], index[:, 1]] = float("-inf")


def _apply_guided(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Each guided row's grammar as a bitmask: filled on the host, one pinned copy to the device, one masking."""
    guided = [i for i, row in enumerate(rows) if row.guided is not None]
    if not guided:
        return
    from lmd.turbomind.guided import allocate_bitmask, apply_bitmask

    bitmask = allocate_bitmask(len(rows), logits.shape[1])
    masked = [i for i in guided if rows[i].guided.fill_next_token_bitmask(bitmask, i)]  # type: ignore[union-attr]
    if masked:
        apply_bitmask(logits, bitmask, torch.tensor(masked))


def _sample_top_k_top_p(logits: torch.Tensor, configs: list[GenerationConfig], uniforms: torch.Tensor) -> torch.Tensor:
    probs, sorted_ids = _filtered_sorted_probs(logits, configs)
    return sorted_ids.gather(1, draw(probs, uniforms).unsqueeze(1)).squeeze(1)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row by inverse CDF with its uniform ([n, 1]); rows need not sum to 1. An index of probability 0
    is never drawn: the CDF is flat over it, and the clamp guards the draw that rounds up to the total itself."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    position = torch.searchsorted(cdf, uniforms * total, right=True)
    last_positive = (cdf < total).sum(dim=-1, keepdim=True)
    return torch.minimum(position, last_positive).squeeze(1)


def _filtered_sorted_probs(logits: torch.Tensor, configs: list[GenerationConfig]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, then top-k, then top-p: each row's probabilities in descending order (0 where filtered out),
    and the token id at each position."""
    vocab = logits.shape[1]
    device = logits.device
    # A positive temperature this small is greedy in effect; the floor keeps logits / temperature finite.
    temperature = to_device([max(c.temperature, MIN_TEMPERATURE) for c in configs], logits.dtype, device).unsqueeze(1)
    top_k = to_device([min(c.top_k, vocab) if c.top_k > 0 else vocab for c in configs], torch.int64, device)
    # top_p = 1 means off: an infinite threshold never removes a token, even when the cumulative sum rounds to 1.
    top_p = to_device([c.top_p if c.top_p < 1.0 else float("inf") for c in configs], logits.dtype, device).unsqueeze(1)

    sorted_logits, sorted_ids = (logits / temperature).sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
    # min_p: p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p) (off at 0: log 0 = -inf keeps every token)
    min_p = to_device([c.min_p for c in configs], sorted_logits.dtype, device).unsqueeze(1)
    floor = torch.maximum(kth, sorted_logits[:, :1] + min_p.log())
    sorted_logits = sorted_logits.masked_fill(sorted_logits < floor, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p
    drop[:, 0] = False
    return probs.masked_fill(drop, 0.0), sorted_ids


def pending_sample(raw: torch.Tensor, chosen: torch.Tensor, rows: list[SamplingRow]) -> PendingSample:
    """The chosen tokens with their raw logprobs (where the rows ask for them), on their way to the host."""
    wanted = [i for i, row in enumerate(rows) if row.config.logprobs is not None]
    if not wanted:
        return PendingSample(chosen, rows)
    index = to_device(wanted, torch.int64, raw.device)
    log_probs = raw[index].log_softmax(dim=-1)
    picked = log_probs.gather(1, chosen[index].unsqueeze(1)).squeeze(1)
    k = min(max(rows[i].config.logprobs for i in wanted), raw.shape[1])
    top_values, top_ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0], log_probs[:, :0].long())
    return PendingSample(chosen, rows, wanted, picked, top_values, top_ids)
