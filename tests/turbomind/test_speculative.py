"""Speculative decoding with n-gram prompt lookup and draft models: greedy streams token-identical to plain decoding
(stop strings, stop ids, lengths, logprobs, penalties, preemption, abort), block accounting exact. Sampling:
test_speculative_sampling.py."""

from __future__ import annotations

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.speculative.config import SpeculativeConfig, parse_tree
from lmd.turbomind.speculative.layer_draft import first_layers_workspace
from lmd.turbomind.speculative.ngram import NgramIndex
from lmd.turbomind.speculative.request import SpeculativeRequest

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1)


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so that lookups find matches (the tiny random model also loops)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for n in (7, 12, 5, 9, 15, 4):
        part = torch.randint(0, 49152, (n,), generator=g).tolist()
        out.append(part + part[: n // 2] + part)
    return out


def _run(ws, configs, speculative=None, abort_at=None, prompts=None, one_at_a_time=False, **options):
    engine = Engine(ws, start=False, speculative=speculative, cache_block_seq_len=4, max_context_token_num=64,
                    **{"cache_max_entry_count": 96, **options})
    prompts = prompts or _prompts()
    results = []
    groups = [[i] for i in range(len(configs))] if one_at_a_time else [list(range(len(configs)))]
    steps = 0
    for group in groups:
        streams = {i: engine.generate(prompts[i], configs[i], request_id=i) for i in group}
        while engine.step():
            steps += 1
            if steps == abort_at:
                engine.abort(2)
        results += [[(d.text, d.token_ids, d.finish_reason, d.logprobs) for d in streams[i]] for i in group]
    stats = engine.stats()
    assert stats.blocks_free == stats.blocks_total and stats.running == 0
    drafter = engine.speculator.drafter if engine.speculator is not None else None
    if drafter is not None:  # the draft's own pool is full again too
        assert drafter.block_manager.num_free == drafter.block_manager.num_blocks
    return results, stats


def _tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d[1]]


def _text(deltas) -> str:
    return "".join(d[0] for d in deltas)


def test_ngram_index_proposes_the_latest_continuation():
    index = NgramIndex(1, 3)
    ids = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6]
    assert index.propose(ids, 3) == [7, 1, 2]  # (5, 6) last seen before 7, 1, 2
    ids += [7]
    assert index.propose(ids, 2) == [1, 2]  # (5, 6, 7) latest at position 5
    assert index.propose(ids, 0) == []
    assert NgramIndex(2, 3).propose([1, 2, 3, 4], 4) == []  # no repeated n-gram
    assert index.propose(ids + [3], 1) == []  # 3 never seen before
    assert index.propose(ids + [3, 9], 2) == [5, 6]  # only the 1-gram (9,) matches


def test_backoff_and_proposal_length():
    request = SpeculativeRequest(NGRAM)
    ids = [1, 2, 3, 4, 5, 6, 1, 2]
    assert request.propose(ids, 9) == [3, 4, 5, 6]  # K = 4
    request.record(4, 0)
    assert request.propose(ids, 9) == []  # one plain step
    assert request.propose(ids, 9) == [3]  # the last accepted run (none) + 1
    request.record(1, 0)
    assert [request.propose(ids, 9) for _ in range(3)] == [[], [], [3]]  # two plain steps
    request.record(1, 1)  # all accepted: one more next time
    assert request.propose(ids, 9) == [3, 4]
    request.record(2, 2)
    assert request.propose(ids, 9) == [3, 4, 5]
    request.record(3, 1)  # a run of 1 accepted: 2 next
    assert request.propose(ids, 9) == [3, 4]
    assert request.propose(ids, 1) == [3]  # never more than the room left


def test_config_checks():
    assert parse_tree("2x4") == (2, 4)
    with pytest.raises(LmdError, match="BRANCHxDEPTH"):
        parse_tree("2-4")
    with pytest.raises(LmdError, match="needs --speculative-model"):
        SpeculativeConfig("draft")
    with pytest.raises(LmdError, match="needs --speculative-method draft"):
        SpeculativeConfig("ngram", model="ws")
    with pytest.raises(LmdError, match="unknown"):
        SpeculativeConfig("medusa")
    assert SpeculativeConfig("ngram", tree=(2, 3)).num_speculative_tokens == 3  # a tree's depth is its K
    with pytest.raises(LmdError, match="a tree's depth is its proposal length"):
        SpeculativeConfig("ngram", 5, tree=(2, 3))
    with pytest.raises(LmdError, match="at most 63 tree tokens"):
        SpeculativeConfig("ngram", tree=(8, 8))


def _greedy_configs(reference_texts=None) -> list[GenerationConfig]:
    lengths = [20, 13, 31, 8, 25, 17]
    configs = []
    for i, n in enumerate(lengths):
        extra = {}
        if reference_texts is not None and i in (0, 4):  # a stop string cut from the free-running text
            text = reference_texts[i]
            word = text[len(text) // 2:len(text) // 2 + 3]
            if word.strip():
                extra["stop_words"] = [word]
        if i == 1:
            extra.update(logprobs=2)
        if i == 3:
            extra.update(repetition_penalty=1.2, min_new_tokens=5)
        configs.append(GenerationConfig(max_new_tokens=n, temperature=0, ignore_eos=i != 5, **extra))
    return configs


def test_greedy_ngram_streams_equal_plain_decoding(tiny_llama_ws):
    ws = tiny_llama_ws[1]
    free, _ = _run(ws, _greedy_configs())
    configs = _greedy_configs([_text(d) for d in free])
    assert sum(c.stop_words is not None for c in configs) >= 1
    for one in (True, False):
        plain, plain_stats = _run(ws, configs, one_at_a_time=one)
        ours, stats = _run(ws, configs, NGRAM, one_at_a_time=one)
        assert [_tokens(d) for d in ours] == [_tokens(d) for d in plain]
        assert [_text(d) for d in ours] == [_text(d) for d in plain]
        assert [d[-1][2] for d in ours] == [d[-1][2] for d in plain]
        lp_ours = [x for d in ours[1] for x in d[3]]
        lp_plain = [x for d in plain[1] for x in d[3]]
        assert lp_ours == pytest.approx(lp_plain, abs=1e-4)
        assert stats.generated_tokens == plain_stats.generated_tokens
        assert stats.speculative_method == "ngram"
        assert stats.spec_accepted_tokens > 0 and stats.spec_proposed_tokens > stats.spec_accepted_tokens
        assert stats.steps < plain_stats.steps  # accepted proposals saved steps
        assert 1 < stats.spec_mean_accepted_length <= 1 + NGRAM.num_speculative_tokens


def test_greedy_ngram_with_preemption_and_abort(tiny_llama_ws):
    ws = tiny_llama_ws[1]
    configs = [GenerationConfig(max_new_tokens=18, temperature=0, ignore_eos=True) for _ in range(6)]
    small = dict(cache_max_entry_count=40)  # 160 tokens of KV for six requests of up to 57: preemption
    plain, _ = _run(ws, configs, abort_at=None, **small)
    ours, stats = _run(ws, configs, NGRAM, **small)
    assert stats.preemptions > 0
    assert [_tokens(d) for d in ours] == [_tokens(d) for d in plain]
    aborted, _ = _run(ws, configs, NGRAM, abort_at=4, **small)
    assert aborted[2][-1][2] == "abort"
    assert _tokens(aborted[2]) == _tokens(plain[2])[:len(_tokens(aborted[2]))]
    assert all(_tokens(d) == _tokens(plain[i]) for i, d in enumerate(aborted) if i != 2)


def test_refused_combinations(tiny_llama_ws):
    engine = Engine(tiny_llama_ws[1], start=False, speculative=NGRAM, cache_max_entry_count=16)
    with pytest.raises(LmdError, match="one sample per prompt"):
        engine.generate_samples([1, 2, 3], GenerationConfig(n=2, temperature=1.0))


def test_flags_and_counters_reach_options_metrics_and_reports():
    from lmd.bench.report import speculative_summary
    from lmd.engine_options import speculative_overrides
    from lmd.serve.metrics import RequestCounts, render_metrics
    from lmd.turbomind.engine import EngineStats

    assert speculative_overrides(None) == {}
    assert speculative_overrides("ngram", num_tokens=6) == {"speculative": SpeculativeConfig("ngram", 6)}
    assert speculative_overrides("draft", "ws", None, "2x3")["speculative"].tree == (2, 3)
    with pytest.raises(LmdError, match="--num-speculative-tokens need --speculative-method"):
        speculative_overrides(None, num_tokens=3)
    stats = EngineStats(0, 0, 8, 0, 8, 0, 10, 10, 0, 10, 0, 5, speculative_method="ngram", spec_verifications=4,
                        spec_proposed_tokens=12, spec_accepted_tokens=6)
    assert stats.spec_mean_accepted_length == 2.5
    text = render_metrics(stats, RequestCounts())
    assert 'lmd_spec_accepted_tokens_total{method="ngram"} 6' in text
    assert 'lmd_spec_mean_accepted_length{method="ngram"} 2.5' in text
    assert "lmd_spec" not in render_metrics(EngineStats(0, 0, 8, 0, 8, 0, 0, 0, 0, 0, 0, 0), RequestCounts())
    summary = speculative_summary(dict(spec_verifications=4, spec_proposed_tokens=12, spec_accepted_tokens=6))
    assert summary == "6 / 12 (50%), mean accepted length 2.50"
    assert speculative_summary(dict(spec_verifications=0)) is None


@pytest.mark.parametrize("layers", [2, 1])
def test_draft_model_greedy_streams_equal_plain_decoding(tiny_llama_ws, tmp_path, layers):
    """The draft is the model itself (every proposal accepted) or its first layer and head (some rejected)."""
    ws = tiny_llama_ws[1]
    draft = SpeculativeConfig("draft", 3, model=str(first_layers_workspace(ws, layers, tmp_path / "draft")))
    configs = _greedy_configs()
    for one in (True, False):
        plain, _ = _run(ws, configs, one_at_a_time=one)
        ours, stats = _run(ws, configs, draft, one_at_a_time=one)
        assert [_tokens(d) for d in ours] == [_tokens(d) for d in plain]
        assert [_text(d) for d in ours] == [_text(d) for d in plain]
        assert stats.speculative_method == "draft" and stats.spec_accepted_tokens > 0
        if layers == 2:
            assert stats.spec_accepted_tokens >= 0.9 * stats.spec_proposed_tokens  # a penalised request differs
        else:
            assert stats.spec_accepted_tokens < stats.spec_proposed_tokens


def test_draft_model_with_preemption_and_abort(tiny_llama_ws, tmp_path):
    ws = tiny_llama_ws[1]
    draft = SpeculativeConfig("draft", 3, model=str(first_layers_workspace(ws, 1, tmp_path / "draft")))
    configs = [GenerationConfig(max_new_tokens=18, temperature=0, ignore_eos=True) for _ in range(6)]
    small = dict(cache_max_entry_count=40)
    plain, _ = _run(ws, configs, **small)
    ours, stats = _run(ws, configs, draft, abort_at=4, **small)
    assert stats.preemptions > 0 and ours[2][-1][2] == "abort"
    assert all(_tokens(d) == _tokens(plain[i]) for i, d in enumerate(ours) if i != 2)
