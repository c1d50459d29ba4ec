from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lmd.errors import LmdError
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.sampler import (
    Sampler,
    SamplingRow,
    _apply_repetition_penalty,
    _filtered_sorted_probs,
    request_generator,
)

VOCAB = 24
EOS = 2


def make_row(config: GenerationConfig, token_ids=(5, 6), num_generated=0, generator=None) -> SamplingRow:
    return SamplingRow(
        config=config, token_ids=list(token_ids), num_generated=num_generated, generator=generator, eos_ids=(EOS,)
    )


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def hf_support(logits: torch.Tensor, config: GenerationConfig) -> set[int]:
    """Tokens that HF's warpers (temperature -> top-k -> top-p, the order `generate` uses) leave finite."""
    scores = logits.unsqueeze(0).clone()
    scores = TemperatureLogitsWarper(config.temperature)(None, scores)
    if config.top_k > 0:
        scores = TopKLogitsWarper(config.top_k)(None, scores)
    if config.top_p < 1.0:
        scores = TopPLogitsWarper(config.top_p)(None, scores)
    return set(torch.isfinite(scores[0]).nonzero().flatten().tolist())


def reference_probs(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[list(hf_support(logits, config))] = True
    return (logits / config.temperature).masked_fill(~keep, float("-inf")).softmax(-1)


def draw(logits_row: torch.Tensor, config: GenerationConfig, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws from one distribution, as a batch of n identical rows."""
    rows = [make_row(config) for _ in range(n)]
    out = Sampler(seed=seed).sample(logits_row.expand(n, -1).contiguous(), rows)
    return torch.tensor(out.token_ids)


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = random_logits(6)
    configs = [
        GenerationConfig(temperature=0.0),
        GenerationConfig(top_k=1, temperature=1.5),
        GenerationConfig(),
        GenerationConfig(temperature=0.0, top_p=0.1),
        GenerationConfig(top_k=1),
        GenerationConfig(top_p=0.5),
    ]
    out = Sampler(seed=0).sample(logits, [make_row(c) for c in configs])
    expected = logits.argmax(-1).tolist()
    for i, config in enumerate(configs):
        if config.is_greedy:
            assert out.token_ids[i] == expected[i]


@pytest.mark.parametrize(
    "config",
    [
        GenerationConfig(temperature=1.0, top_k=5, top_p=1.0),
        GenerationConfig(temperature=1.0, top_k=0, top_p=0.6),
        GenerationConfig(temperature=0.7, top_k=8, top_p=0.7),
        GenerationConfig(temperature=1.3, top_k=0, top_p=0.95),
        GenerationConfig(temperature=0.8, top_k=40, top_p=0.8),  # the defaults; top_k > vocab
    ],
)
def test_empirical_support_equals_hf_warper_support(config):
    logits = random_logits(1, seed=1)[0]
    allowed = hf_support(logits, config)
    assert 1 <= len(allowed) < VOCAB or config.top_p == 0.95
    samples = draw(logits, config, n=4000)
    seen = set(samples.tolist())
    assert seen <= allowed
    probs = reference_probs(logits, config)
    likely = {t for t in allowed if probs[t] > 0.005}  # rarer tokens may legitimately go unseen in 4000 draws
    assert likely <= seen


def test_top_k_top_p_support_equals_hf_warpers_on_many_rows():
    vocab = 1000
    logits = random_logits(64, vocab=vocab, seed=11, scale=3.0)
    configs = [
        GenerationConfig(temperature=t, top_k=k, top_p=p)
        for t, k, p in [
            (1.0, 0, 0.9),
            (0.6, 50, 1.0),
            (1.4, 200, 0.5),
            (0.9, 7, 0.99),
            (1.0, 0, 0.05),
            (2.0, 1000, 0.8),
            (0.3, 20, 0.95),
            (1.0, 2000, 1.0),
        ]
    ] * 8
    probs, ids = _filtered_sorted_probs(logits, configs)
    for i, config in enumerate(configs):
        ours = set(ids[i][probs[i] > 0].tolist())
        assert ours == hf_support(logits[i], config), i
        kept = torch.zeros(vocab)
        kept[ids[i]] = probs[i]
        torch.testing.assert_close(kept / kept.sum(), reference_probs(logits[i], config))


@pytest.mark.parametrize(
    "config",
    [
        GenerationConfig(temperature=1.0, top_k=0, top_p=1.0),
        GenerationConfig(temperature=0.5, top_k=0, top_p=1.0),
        GenerationConfig(temperature=1.7, top_k=10, top_p=1.0),
        GenerationConfig(temperature=1.0, top_k=0, top_p=0.9),
    ],
)
def test_sampled_frequencies_match_the_renormalised_softmax(config):
    logits = random_logits(1, vocab=12, seed=2, scale=1.0)[0]
    n = 20000
    counts = torch.bincount(draw(logits, config, n=n, seed=3), minlength=12).double()
    probs = reference_probs(logits, config).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, (chi2, dof)  # far beyond the 99.9th percentile of chi2(dof)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hf(penalty):
    logits = random_logits(3, seed=4)
    contexts = [[1, 5, 5, 9, 23], [0], [7, 3, 3, 3, 11, 12, 13, 2]]
    ours = logits.clone()
    config = GenerationConfig(repetition_penalty=penalty)
    _apply_repetition_penalty(ours, [make_row(config, ids) for ids in contexts])
    for i, ids in enumerate(contexts):
        hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i], hf[0], rtol=0, atol=0)


def test_repetition_penalty_changes_the_greedy_choice_only_for_rows_that_ask():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 2.0
    logits[:, 8] = 1.9
    rows = [
        make_row(GenerationConfig(temperature=0.0, repetition_penalty=1.2), token_ids=[7]),
        make_row(GenerationConfig(temperature=0.0), token_ids=[7]),
    ]
    assert Sampler().sample(logits, rows).token_ids == [8, 7]


def test_seeded_rows_are_reproducible_whatever_the_batch():
    config = GenerationConfig(temperature=1.0, top_k=0, top_p=0.95, seed=1234)
    steps = [random_logits(1, seed=10 + s)[0] for s in range(8)]

    def run(position: int, batch: int, other_seed: int) -> list[int]:
        sampler = Sampler(seed=other_seed)
        generator = request_generator(config)
        others = [torch.Generator().manual_seed(other_seed + j) for j in range(batch)]
        tokens = []
        for s, step in enumerate(steps):
            logits = random_logits(batch, seed=100 * other_seed + s)
            logits[position] = step
            rows = [
                make_row(GenerationConfig(temperature=1.0, top_k=0, top_p=1.0), generator=others[j]) for j in range(batch)
            ]
            rows[position] = make_row(config, generator=generator)
            tokens.append(sampler.sample(logits, rows).token_ids[position])
        return tokens

    alone = run(0, 1, 1)
    assert run(2, 5, 2) == alone
    assert run(0, 3, 3) == alone
    assert len(set(alone)) > 1
    assert alone != run_with_seed(steps, 99)


def run_with_seed(steps: list[torch.Tensor], seed: int) -> list[int]:
    config = GenerationConfig(temperature=1.0, top_k=0, top_p=0.95, seed=seed)
    generator = request_generator(config)
    return [Sampler().sample(s.unsqueeze(0), [make_row(config, generator=generator)]).token_ids[0] for s in steps]


def test_request_generator_is_none_without_seed():
    assert request_generator(GenerationConfig()) is None


@pytest.mark.parametrize(
    "config",
    [
        GenerationConfig(temperature=0.0, min_new_tokens=3, stop_token_ids=(9,)),
        GenerationConfig(temperature=1.0, min_new_tokens=3, stop_token_ids=(9,)),
    ],
)
def test_min_new_tokens_blocks_eos_and_stop_ids(config):
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, EOS] = 20.0
    logits[0, 9] = 19.0
    logits[0, 4] = 0.0
    sampler = Sampler(seed=0)
    for generated in range(3):
        assert sampler.sample(logits, [make_row(config, num_generated=generated)]).token_ids == [4]
    assert sampler.sample(logits, [make_row(config, num_generated=3)]).token_ids[0] in (EOS, 9)


def test_logprobs_are_the_raw_log_softmax():
    logits = random_logits(4, seed=5)
    configs = [
        GenerationConfig(temperature=0.0, logprobs=3),
        GenerationConfig(logprobs=0),
        GenerationConfig(),
        GenerationConfig(temperature=1.0, repetition_penalty=1.5, logprobs=5),
    ]
    out = Sampler(seed=0).sample(logits, [make_row(c, token_ids=[3, 4]) for c in configs])
    reference = logits.log_softmax(-1)
    for i, config in enumerate(configs):
        if config.logprobs is None:
            assert out.logprobs[i] is None and out.top_logprobs[i] is None
            continue
        assert out.logprobs[i] == pytest.approx(reference[i, out.token_ids[i]].item(), abs=1e-6)
        values, ids = reference[i].topk(config.logprobs)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.top_logprobs[1] == []


def test_caller_logits_are_not_modified():
    logits = random_logits(2, seed=6)
    before = logits.clone()
    config = GenerationConfig(repetition_penalty=1.5, min_new_tokens=2)
    Sampler().sample(logits, [make_row(config, token_ids=[EOS, 3]), make_row(config)])
    assert torch.equal(logits, before)


def test_shape_mismatch_is_an_lmd_error():
    with pytest.raises(LmdError, match="2 rows"):
        Sampler().sample(torch.zeros(3, VOCAB), [make_row(GenerationConfig())] * 2)


def test_tiny_positive_temperature_is_finite_and_picks_the_argmax():
    logits = random_logits(3, seed=7, scale=30.0)
    rows = [make_row(GenerationConfig(temperature=1e-30, top_k=0, top_p=1.0)) for _ in range(3)]
    assert Sampler(seed=0).sample(logits, rows).token_ids == logits.argmax(-1).tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_logits_give_the_cpu_tokens_with_cpu_generators_and_accept_cuda_generators():
    logits = random_logits(16, vocab=4096, seed=8)
    configs = [
        GenerationConfig(temperature=0.9, top_k=k, top_p=p, seed=s, logprobs=2, repetition_penalty=1.1)
        for s, (k, p) in enumerate([(0, 1.0), (40, 0.8), (5, 0.95), (1, 1.0)] * 4)
    ]

    def rows(device: str) -> list[SamplingRow]:
        return [make_row(c, token_ids=[1, 2, 3], generator=request_generator(c, device)) for c in configs]

    cpu = Sampler(seed=0).sample(logits, rows("cpu"))
    cuda = Sampler(seed=0).sample(logits.cuda(), rows("cpu"))
    assert cuda.token_ids == cpu.token_ids
    assert cuda.logprobs == pytest.approx(cpu.logprobs, abs=1e-4)
    first = Sampler(seed=0).sample(logits.cuda(), rows("cuda")).token_ids
    assert Sampler(seed=1).sample(logits.cuda(), rows("cuda")).token_ids == first


def test_a_step_with_no_rows_to_sample_returns_empty_lists():
    out = Sampler().sample(torch.zeros(0, VOCAB), [])
    assert (out.token_ids, out.logprobs, out.top_logprobs) == ([], [], [])


def test_plain_greedy_batch_takes_the_raw_argmax_like_the_general_path() -> None:
    logits = random_logits(6, seed=21)
    greedy = GenerationConfig(temperature=0.0)
    rows = [make_row(greedy, num_generated=3) for _ in range(6)]
    fast = Sampler(seed=0).sample(logits, rows)  # every row plain greedy: one argmax
    assert fast.token_ids == logits.argmax(-1).tolist() and fast.logprobs == [None] * 6
    # one row asking for logprobs sends the batch down the general path: the greedy rows' tokens do not change
    mixed = Sampler(seed=0).sample(logits, [*rows[:5], make_row(GenerationConfig(temperature=0.0, logprobs=1), (5,), 3)])
    assert mixed.token_ids == fast.token_ids and mixed.logprobs[5] is not None
    # min_new_tokens still unmet: EOS is masked, so the fast path must not run
    eos_first = logits.clone()
    eos_first[0, EOS] = 100.0
    early = make_row(GenerationConfig(temperature=0.0, min_new_tokens=5), (5,), 1)
    assert Sampler(seed=0).sample(eos_first[:1], [early]).token_ids[0] != EOS


def test_presence_and_frequency_penalties_follow_openai_over_generated_tokens():
    from lmd.turbomind.sampler import _apply_presence_frequency

    logits = random_logits(3)
    config = GenerationConfig(presence_penalty=0.5, frequency_penalty=0.25)
    rows = [make_row(config, token_ids=(5, 6, 3, 3, 7), num_generated=3),  # generated: 3, 3, 7
            make_row(config, token_ids=(5, 6, 3), num_generated=0),  # the prompt does not count
            make_row(GenerationConfig(), token_ids=(3, 3), num_generated=2)]  # no penalty asked
    out = logits.clone()
    _apply_presence_frequency(out, rows)
    expected = logits.clone()
    for token, count in ((3, 2), (7, 1)):
        expected[0, token] -= 0.25 * count + 0.5
    assert torch.equal(out, expected)
    negative = GenerationConfig(presence_penalty=-1.0, frequency_penalty=-2.0)  # negative values encourage repeats
    out = logits[:1].clone()
    _apply_presence_frequency(out, [make_row(negative, token_ids=(9, 9), num_generated=2)])
    assert torch.isclose(out[0, 9], logits[0, 9] + 1.0 + 4.0)


def test_logit_bias_moves_the_choice_and_logprobs_stay_raw():
    logits = random_logits(2)
    best = int(logits[0].argmax())
    second = int(logits[0].topk(2).indices[1])
    rows = [make_row(GenerationConfig(temperature=0, logit_bias={best: -100.0}, logprobs=0)),
            make_row(GenerationConfig(temperature=0, logit_bias={11: 100.0}))]
    out = Sampler(seed=0).sample(logits.clone(), rows)
    assert out.token_ids == [second, 11]
    assert out.logprobs[0] == pytest.approx(float(logits[0].log_softmax(-1)[second]), abs=1e-6)


def test_min_p_keeps_what_transformers_min_p_keeps():
    from transformers.generation.logits_process import MinPLogitsWarper

    for seed in range(5):
        logits = random_logits(1, seed=seed)[0]
        config = GenerationConfig(temperature=0.7, top_k=0, top_p=1.0, min_p=0.2)
        probs, ids = _filtered_sorted_probs(logits.unsqueeze(0), [config])
        ours = set(ids[0][probs[0] > 0].tolist())
        scores = MinPLogitsWarper(0.2)(None, TemperatureLogitsWarper(0.7)(None, logits.unsqueeze(0).clone()))
        assert ours == set(torch.isfinite(scores[0]).nonzero().flatten().tolist())
        assert 1 <= len(ours) < VOCAB
        drawn = set(draw(logits, config, 400, seed=seed).tolist())
        assert drawn <= ours


def test_openai_sampling_fields_are_validated():
    config = GenerationConfig(logit_bias={7: 1.5, 3: -2})
    assert config.logit_bias == ((3, -2.0), (7, 1.5)) and hash(config)
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-2.01), dict(min_p=1.5),
                dict(logit_bias={-1: 1.0}), dict(logit_bias={3: 101}), dict(logit_bias=5)):
        with pytest.raises(LmdError, match=f"GenerationConfig.{next(iter(bad))}="):
            GenerationConfig(**bad)
