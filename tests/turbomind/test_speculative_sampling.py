"""Speculative decoding at temperature > 0 keeps the target's distribution: the rejection rule on its own (many
draws, total variation), and the engine's short continuations with n-gram and draft-model proposals against the
exact distribution of plain sampling (chi-square goodness of fit), seeded requests repeatable, the pools full again."""

from __future__ import annotations

import pytest
import torch

from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.sampler import SamplingRow, draw, sampling_probs
from lmd.turbomind.speculative.config import SpeculativeConfig
from lmd.turbomind.speculative.layer_draft import first_layers_workspace
from lmd.turbomind.speculative.verify import rejection_tokens

# Penalty, bias, temperature, top-k, top-p: p is what plain sampling draws from, and the draft's q is processed alike.
CONFIG = dict(max_new_tokens=4, temperature=0.9, top_k=3, top_p=0.9, repetition_penalty=1.2, logit_bias={7: 1.0},
              ignore_eos=True)
SAMPLES = 1200


def _chi_square_p(observed: dict, expected: dict[tuple, float]) -> tuple[float, int]:
    """p-value of the chi-square goodness of fit of counts to probabilities (cells expected fewer than 5 times
    merged into one)."""
    n = sum(observed.values())
    assert set(observed) <= set(expected), set(observed) - set(expected)  # nothing outside the support
    cells, rest = [], [0.0, 0.0]
    for key, prob in expected.items():
        pair = [observed.get(key, 0), prob * n]
        if pair[1] < 5:
            rest = [rest[0] + pair[0], rest[1] + pair[1]]
        else:
            cells.append(pair)
    if rest[1] > 0:
        cells.append(rest)
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))), df


def test_rejection_rule_draws_from_p():
    """One row, proposals drawn from q (a spread q, then a point mass): the kept token is distributed as p."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 6, 200_000
    p = torch.tensor([0.30, 0.25, 0.0, 0.20, 0.15, 0.10])
    for q in (torch.tensor([0.05, 0.40, 0.30, 0.05, 0.0, 0.20]), torch.nn.functional.one_hot(torch.tensor(1), vocab)):
        q = q.float()
        proposals = draw(q.expand(n, vocab), torch.rand(n, 1, generator=g, dtype=torch.float64))
        tokens = rejection_tokens(p.expand(n, vocab), proposals, q.expand(n, vocab),
                                  torch.rand(n, 1, generator=g, dtype=torch.float64),
                                  torch.rand(n, 1, generator=g, dtype=torch.float64))
        freq = torch.bincount(tokens, minlength=vocab).float() / n
        assert freq[2] == 0  # p(2) = 0 although q proposes it
        assert 0.5 * (freq - p).abs().sum() < 0.01  # sampling noise ~0.0025
        kept = float((tokens == proposals).float().mean())
        assert kept == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.01)  # acceptance = sum min(p, q)
    bonus = rejection_tokens(p.expand(n, vocab), torch.full((n,), -1), torch.zeros(n, vocab),
                             torch.rand(n, 1, generator=g, dtype=torch.float64),
                             torch.rand(n, 1, generator=g, dtype=torch.float64))
    assert 0.5 * (torch.bincount(bonus, minlength=vocab).float() / n - p).abs().sum() < 0.01


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """(HF dir, workspace, prompt) of a tiny random Llama over 64 tokens; the prompt ends with the model's own
    greedy loop, so n-gram lookups find matches."""
    from tests.conftest import deploy_tiny

    src, ws = deploy_tiny(tmp_path_factory.mktemp("tiny-vocab64"), "llama", model_name="hf", vocab_size=64)
    engine = Engine(ws, start=False, cache_max_entry_count=64)
    loop = engine.generate([5, 9, 13], GenerationConfig(max_new_tokens=12, temperature=0, ignore_eos=True))
    while engine.step():
        pass
    return src, ws, [5, 9, 13] + list(loop.result().token_ids)


def _exact(src, prompt: list[int], config: GenerationConfig) -> dict[tuple, float]:
    """Every continuation of config.max_new_tokens tokens with its probability under plain sampling (transformers'
    logits, the sampler's processing)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    out = {(): 1.0}
    for _ in range(config.max_new_tokens):
        grown = {}
        for prefix, mass in out.items():
            ids = prompt + list(prefix)
            with torch.no_grad():
                raw = model(torch.tensor([ids])).logits[0, -1:].float()
            probs = sampling_probs(raw, [SamplingRow(config, ids, len(prefix), None, (2,))])[0]
            for t in probs.nonzero().flatten().tolist():
                grown[prefix + (t,)] = mass * float(probs[t])
        out = grown
    return out


def _counts(engine: Engine, prompt: list[int], seeds: range) -> tuple[dict, list[tuple]]:
    streams = [engine.generate(prompt, GenerationConfig(**CONFIG, seed=s)) for s in seeds]
    while engine.step():
        pass
    outputs = [tuple(stream.result().token_ids) for stream in streams]
    counts: dict = {}
    for key in outputs:
        counts[key] = counts.get(key, 0) + 1
    return counts, outputs


@pytest.mark.parametrize("method", ["ngram", "draft", "ngram-tree", "draft-tree"])
def test_sampled_continuations_keep_the_target_distribution(small_vocab, tmp_path, method):
    """Four-token continuations (the first from the prefill, the others possibly verified; chains, or 3x3 token
    trees by SpecInfer's rule): with speculation and without, each fits the exact distribution (chi-square,
    p > 0.001), while proposals were accepted and rejected."""
    src, ws, prompt = small_vocab
    options = dict(start=False, cache_block_seq_len=4, max_context_token_num=1024, cache_max_entry_count=1024,
                   max_batch_size=128)
    tree = (3, 3) if method.endswith("-tree") else None
    if method.startswith("ngram"):
        spec = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1, tree=tree)
    else:  # the first layer and the head: a q unlike p
        spec = SpeculativeConfig("draft", 3, model=str(first_layers_workspace(ws, 1, tmp_path / "draft")), tree=tree)
    exact = _exact(src, prompt, GenerationConfig(**CONFIG))
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-6)
    engine = Engine(ws, speculative=spec, **options)
    ours, outputs = _counts(engine, prompt, range(SAMPLES))
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    assert stats.blocks_free == stats.blocks_total and stats.running == 0
    drafter = engine.speculator.drafter
    if drafter is not None:
        assert drafter.block_manager.num_free == drafter.block_manager.num_blocks
    again = Engine(ws, speculative=spec, **options)  # seeded requests repeat themselves, alone or batched
    assert _counts(again, prompt, range(8))[1] == outputs[:8]
    plain, _ = _counts(Engine(ws, **options), prompt, range(SAMPLES, 2 * SAMPLES))
    for counts in (ours, plain):
        p, df = _chi_square_p(counts, exact)
        assert df >= 8
        assert p > 1e-3, (method, p, df, counts)
