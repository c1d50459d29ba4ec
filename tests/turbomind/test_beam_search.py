"""Beam search (`GenerationConfig(beam_width=k, length_penalty=..., early_stopping=...)`): the n best beams equal
transformers' `generate(num_beams=k, num_return_sequences=n, do_sample=False)` token for token, beams share their
KV blocks, preemption and abort leave the pool whole, and what beam search cannot honour is refused."""

from __future__ import annotations

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig

NEW_TOKENS = 14


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(ws, **options) -> Engine:
    return Engine(ws, start=False, cache_block_seq_len=4, max_context_token_num=64,
                  **{"cache_max_entry_count": 256, **options})


def _drain(engine: Engine) -> None:
    while engine.step():
        pass


@pytest.fixture(scope="module")
def hf_model(tiny_llama_ws):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_ws[0], dtype=torch.float32).eval()


def _hf_beams(model, prompt: list[int], config: GenerationConfig, end_ids: list[int]) -> list[list[int]]:
    from transformers import GenerationConfig as HFConfig

    hf = HFConfig(num_beams=config.beam_width, num_return_sequences=config.n, do_sample=False,
                  length_penalty=config.length_penalty, early_stopping=config.early_stopping,
                  max_new_tokens=config.max_new_tokens, eos_token_id=end_ids, pad_token_id=end_ids[0])
    out = model.generate(torch.tensor([prompt]), generation_config=hf)
    rows = []
    for row in out[:, len(prompt):].tolist():  # padding after a beam's end token dropped
        rows.append(row[:next((i + 1 for i, t in enumerate(row) if t in end_ids), len(row))])
    return rows


def _stop_token(engine: Engine, prompt: list[int], at: int) -> int:
    """A token the model's greedy continuation reaches: as a stop token it makes beams end early."""
    stream = engine.generate(prompt, GenerationConfig(max_new_tokens=at + 1, temperature=0, ignore_eos=True))
    _drain(engine)
    return stream.result().token_ids[at]


SETTINGS = [  # beam_width, n, length_penalty, early_stopping
    (2, 1, 1.0, False), (4, 2, 1.0, False), (3, 3, 0.5, True), (4, 1, -1.0, "never"), (4, 4, 2.0, "never"),
    (4, 4, 0.0, False),
]


@pytest.mark.parametrize(("width", "n", "length_penalty", "early_stopping"), SETTINGS)
def test_beams_equal_transformers(tiny_llama_ws, hf_model, width, n, length_penalty, early_stopping):
    engine = _engine(tiny_llama_ws[1])
    finishes = set()
    for seed in range(3):
        prompt = _prompt(5 + 3 * seed, seed)
        stop = _stop_token(engine, prompt, 2 + seed)  # the beams meet an end token early and late
        config = GenerationConfig(beam_width=width, n=n, length_penalty=length_penalty, early_stopping=early_stopping,
                                  max_new_tokens=NEW_TOKENS, temperature=0, stop_token_ids=[stop])
        streams = engine.generate_samples(prompt, config, request_id=f"r{seed}")
        _drain(engine)
        results = [s.result() for s in streams]
        end_ids = list(dict.fromkeys([stop, *engine.eos_ids]))
        assert [r.token_ids for r in results] == _hf_beams(hf_model, prompt, config, end_ids), (seed, results)
        assert [s.request_id for s in streams] == ([f"r{seed}"] if n == 1 else [(f"r{seed}", i) for i in range(n)])
        for r in results:
            assert r.finish_reason == ("stop" if r.token_ids[-1] == stop else "length")
            assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(r.token_ids)
            finishes.add(r.finish_reason)
        stats = engine.stats()
        assert stats.blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert finishes == {"stop", "length"} or early_stopping == "never"


def test_text_is_the_tokens_decoded_without_the_stop_token(tiny_llama_ws):
    engine = _engine(tiny_llama_ws[1])
    prompt = _prompt(9, 1)
    stop = _stop_token(engine, prompt, 3)
    streams = engine.generate_samples(prompt, GenerationConfig(beam_width=3, n=3, max_new_tokens=10, temperature=0,
                                                               stop_token_ids=[stop]))
    _drain(engine)
    for result in (s.result() for s in streams):
        shown = result.token_ids[:-1] if result.finish_reason == "stop" else result.token_ids
        assert result.text == engine.tokenizer.decode(shown, skip_special_tokens=True)


def test_beams_share_blocks_by_reference(tiny_llama_ws):
    engine = _engine(tiny_llama_ws[1])
    prompt = _prompt(21, 2)  # 5 full blocks of 4 and a partly filled one
    stream = engine.generate(prompt, GenerationConfig(beam_width=4, max_new_tokens=NEW_TOKENS, temperature=0,
                                                      ignore_eos=True))
    engine.step()  # the prefill; its round forks the prompt into 4 beams
    beams = engine.scheduler.running
    assert len(beams) == 4
    assert all(b.block_table[:5] == beams[0].block_table[:5] for b in beams)
    assert all(engine.block_manager.blocks[i].ref_count == 4 for i in beams[0].block_table[:5])
    assert len({b.block_table[5] for b in beams}) == 4  # the partly filled block: copied per beam
    _drain(engine)
    assert len(stream.result().token_ids) == NEW_TOKENS
    assert engine.stats().blocks_used == 0


def test_preemption_and_other_requests_leave_the_beams_as_alone(tiny_llama_ws):
    alone = _engine(tiny_llama_ws[1])
    config = GenerationConfig(beam_width=3, n=2, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    prompts = [_prompt(7 + 4 * i, 10 + i) for i in range(3)]
    expected = []
    for prompt in prompts:
        streams = alone.generate_samples(prompt, config)
        _drain(alone)
        expected.append([s.result().token_ids for s in streams])
    # 3 beam searches and 2 plain requests in a pool that holds about one search at a time
    need = 3 * alone.block_manager.blocks_for(max(len(p) for p in prompts) + NEW_TOKENS)
    engine = _engine(tiny_llama_ws[1], cache_max_entry_count=need + 2)
    plain = [engine.generate(_prompt(11, 20 + i), GenerationConfig(max_new_tokens=12, temperature=0,
                                                                   ignore_eos=True)) for i in range(2)]
    searches = [engine.generate_samples(p, config) for p in prompts]
    _drain(engine)
    assert [[s.result().token_ids for s in streams] for streams in searches] == expected
    assert all(len(p.result().token_ids) == 12 for p in plain)
    stats = engine.stats()
    assert stats.preemptions > 0
    assert stats.blocks_used == 0 and stats.blocks_free == need + 2


def test_abort_ends_every_stream_of_the_search(tiny_llama_ws):
    engine = _engine(tiny_llama_ws[1])
    streams = engine.generate_samples(_prompt(9, 3), GenerationConfig(beam_width=4, n=2, max_new_tokens=40,
                                                                      temperature=0, ignore_eos=True),
                                      request_id="b")
    for _ in range(3):
        engine.step()
    engine.abort(("b", 1))
    _drain(engine)
    assert [s.result().finish_reason for s in streams] == ["abort", "abort"]
    assert engine.stats().blocks_used == 0 and engine.stats().running == 0


def test_engine_thread_and_close(tiny_llama_ws):
    with Engine(tiny_llama_ws[1], cache_block_seq_len=4, cache_max_entry_count=256) as engine:
        config = GenerationConfig(beam_width=2, max_new_tokens=6, temperature=0, ignore_eos=True)
        assert len(engine.generate(_prompt(6, 4), config).result().token_ids) == 6
        pending = engine.generate(_prompt(6, 5), GenerationConfig(beam_width=2, max_new_tokens=400, temperature=0,
                                                                  ignore_eos=True))
    assert pending.result().finish_reason in ("abort", "length")


@pytest.mark.parametrize(("options", "named"), [
    (dict(temperature=0.7), "temperature"),
    (dict(n=3), "n"),
    (dict(best_of=2), "n"),
    (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(logprobs=2), "logprobs"),
    (dict(stop_words=["x"]), "stop_words"),
    (dict(min_new_tokens=2), "min_new_tokens"),
    (dict(beam_width=0), "beam_width"),
    (dict(early_stopping="sometimes"), "early_stopping"),
])
def test_what_beam_search_cannot_honour_is_refused(options, named):
    with pytest.raises(LmdError, match=f"GenerationConfig.{named}="):
        GenerationConfig(**{"beam_width": 2, "temperature": 0, **options})


def test_a_pool_too_small_for_the_beams_is_refused(tiny_llama_ws):
    engine = _engine(tiny_llama_ws[1], cache_max_entry_count=16)
    with pytest.raises(LmdError, match="beam_width=8 .* KV blocks"):
        engine.generate(_prompt(9, 6), GenerationConfig(beam_width=8, max_new_tokens=20, temperature=0))


def test_idle_beams_of_another_search_give_way_to_a_waiting_beam(tiny_llama_ws):
    """Each search has a beam preempted and one idle (it reported, its sibling has not); no free block admits the
    waiting beams: the engine preempts the other search's idle beam rather than wait forever."""
    engine = _engine(tiny_llama_ws[1], enable_prefix_caching=False)
    config = GenerationConfig(beam_width=2, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    alone = _engine(tiny_llama_ws[1])
    expected = []
    for seed in (7, 8):
        stream = alone.generate(_prompt(10, seed), config)
        _drain(alone)
        expected.append(stream.result().token_ids)
    streams = [engine.generate(_prompt(10, seed), config) for seed in (7, 8)]
    engine.step()  # both prefills; each forks into 2 beams
    scheduler, bm = engine.scheduler, engine.block_manager
    a0, b0, a1, b1 = scheduler.running  # the prompts, then their forks
    for seq in (a1, b1):
        scheduler.preempt(seq)
    held = bm.allocate_blocks(bm.num_free)  # nothing is left to admit a1 or b1 with
    engine.step()  # a0 and b0 report and idle (their next token fits their last block); a1 and b1 wait
    assert engine.step()  # nothing could run: a0 gives way to b1, the head of the queue
    assert a0 in scheduler.waiting and b1 in scheduler.running and a0.num_preemptions == 1
    bm.release_blocks(held)
    _drain(engine)
    assert [s.result().token_ids for s in streams] == expected
    assert engine.stats().blocks_used == 0


def test_pipeline_in_and_out_of_the_engine_process(tiny_llama_ws):
    import lmd

    config = GenerationConfig(beam_width=3, n=2, max_new_tokens=8, temperature=0, ignore_eos=True)
    prompts = [_prompt(8, 30), _prompt(12, 31)]
    options = dict(cache_block_seq_len=4, cache_max_entry_count=128, device="cpu")
    with lmd.pipeline(str(tiny_llama_ws[1]), **options) as pipe:
        here = pipe(prompts, config)
        single = pipe(prompts[0], GenerationConfig(beam_width=3, max_new_tokens=8, temperature=0, ignore_eos=True))
    with lmd.pipeline(str(tiny_llama_ws[1]), engine_process=True, **options) as pipe:
        there = pipe(prompts, config)
    assert [[r.token_ids for r in group] for group in here] == [[r.token_ids for r in group] for group in there]
    assert single.token_ids == here[0][0].token_ids  # n=1: the best beam
