"""SmolLM2-135M-Instruct (fp32 workspace deployed from the GGUF) on CPU: greedy output token-identical to HF generate.

LMD_ENGINE_TOKENS sets the generation length (16 in CI; the closing measurement used 64).

The two perplexity tests score 1,022 tokens: enough to catch a broken int4 or int8 path, far too few to resolve the
goals of docs/engine.md (int4 within 0.5 %, KV int8 within 0.3 %), which are measured there on 16,376 tokens. Their
bounds are set from the spread of the same statistic over other windows, package sets and CPU kernels.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from lmd.turbomind.engine import Engine
from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.gen_config import GenerationConfig

pytestmark = pytest.mark.slow

NEW_TOKENS = int(os.environ.get("LMD_ENGINE_TOKENS", "16"))
GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0)
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in one paragraph why the sky is blue.",
    "List three tips for learning a new language.",
    "What is 17 times 23?",
    "Give me a short recipe for pancakes.",
    "Who wrote Pride and Prejudice, and what is it about?",
    "Translate 'good morning, my friend' into Spanish.",
]


@pytest.fixture(scope="module")
def smol_ws(smollm2_gguf, tmp_path_factory):
    from lmd.deploy.converter import deploy

    root = tmp_path_factory.mktemp("smol")
    yield deploy("hf", str(smollm2_gguf), str(root / "ws"), dtype="float32", progress=False)
    shutil.rmtree(root, ignore_errors=True)  # 0.5 GB: CI's disk is not ours to fill


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(smol_ws) -> list[list[int]]:
    engine = Engine(smol_ws, start=False, cache_max_entry_count=4)
    return [engine.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_outputs(hf_model, prompt_ids, smol_ws) -> list[list[int]]:
    from lmd.turbomind.workspace import open_workspace

    eos = list(open_workspace(smol_ws).model.end_ids)
    outputs = []
    for ids in prompt_ids:
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                                pad_token_id=eos[0])
        outputs.append(out[0, len(ids):].tolist())
    return outputs


def _run(engine: Engine, prompt_ids, stagger: int = 0) -> list[list[int]]:
    streams = []
    for ids in prompt_ids:
        streams.append(engine.generate(ids, GREEDY))
        for _ in range(stagger):
            engine.step()
    while engine.step():
        pass
    return [s.result().token_ids for s in streams]


def test_greedy_matches_hf_however_batched(smol_ws, prompt_ids, hf_outputs):
    engine = Engine(smol_ws, start=False, cache_block_seq_len=16, cache_max_entry_count=256)
    one_at_a_time = [_run(engine, [ids])[0] for ids in prompt_ids]
    assert one_at_a_time == hf_outputs
    assert _run(engine, prompt_ids) == hf_outputs
    assert _run(engine, prompt_ids, stagger=3) == hf_outputs
    assert engine.stats().blocks_used == 0


def test_greedy_matches_hf_with_preemption(smol_ws, prompt_ids, hf_outputs):
    longest = max(len(p) for p in prompt_ids) + NEW_TOKENS
    blocks = 3 * -(-longest // 16)  # room for about three of the eight sequences
    engine = Engine(smol_ws, start=False, cache_block_seq_len=16, cache_max_entry_count=blocks)
    assert _run(engine, prompt_ids) == hf_outputs
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.blocks_used == 0 and stats.blocks_free == blocks


def test_greedy_with_ngram_speculation_matches_hf(smol_ws, prompt_ids, hf_outputs):
    from lmd.turbomind.speculative.config import SpeculativeConfig

    for k in (2, 4):
        speculative = SpeculativeConfig("ngram", k, prompt_lookup_min=1)
        engine = Engine(smol_ws, start=False, cache_block_seq_len=16, cache_max_entry_count=256, speculative=speculative)
        assert [_run(engine, [ids])[0] for ids in prompt_ids] == hf_outputs
        assert _run(engine, prompt_ids) == hf_outputs
        stats = engine.stats()
        assert stats.spec_proposed_tokens > 0 and stats.blocks_used == 0


def test_greedy_with_a_weak_draft_model_matches_hf(smol_ws, prompt_ids, hf_outputs, tmp_path):
    from lmd.turbomind.speculative.config import SpeculativeConfig
    from lmd.turbomind.speculative.layer_draft import first_layers_workspace

    draft = first_layers_workspace(smol_ws, 8, tmp_path / "draft")  # the first 8 of 30 layers and the head
    engine = Engine(smol_ws, start=False, cache_block_seq_len=16, cache_max_entry_count=256,
                    speculative=SpeculativeConfig("draft", 3, model=str(draft)))
    assert [_run(engine, [ids])[0] for ids in prompt_ids] == hf_outputs
    assert _run(engine, prompt_ids) == hf_outputs
    stats = engine.stats()
    assert stats.spec_accepted_tokens < stats.spec_proposed_tokens and stats.blocks_used == 0  # rejections


def test_logits_match_hf(smol_ws, hf_model, prompt_ids, hf_outputs):
    engine = Engine(smol_ws, start=False, cache_block_seq_len=16, cache_max_entry_count=64)
    runner = engine.runner
    worst = 0.0
    for ids, out in zip(prompt_ids[:4], hf_outputs[:4], strict=True):
        full = ids + out
        batch = ForwardBatch.build([(full, 0, list(range(64)))], 16, list(range(len(full))), runner.device)
        ours = runner.model.forward(batch, runner.cache)
        with torch.no_grad():
            ref = hf_model(torch.tensor([full])).logits[0].float()
        worst = max(worst, (ours - ref).abs().max().item())
    print(f"max |logits - HF| = {worst:.3g}")
    assert worst < 1e-3  # 2 package sets: 0 with AVX-512 kernels, 7.4e-5 with AVX2


def _wikitext_ids(tokenizer, n: int) -> torch.Tensor:
    from lmd.calib_data import load_eval_text
    from lmd.calib_data.tokenization import encode

    return encode(tokenizer, load_eval_text("wikitext2", "test").text)[: n]


def test_int4_engine_ppl_matches_dequantized_hf(smollm2_hf, tmp_path):
    from lmd.deploy.converter import deploy
    from lmd.eval.ppl import hf_window_scorer, perplexity
    from lmd.turbomind.window_scorer import engine_window_scorer, scoring_engine
    from tests.turbomind.awq_checkpoint import write_awq_checkpoint

    reference = write_awq_checkpoint(smollm2_hf, tmp_path / "awq", group_size=64).eval()
    ws = deploy("hf", str(tmp_path / "awq"), str(tmp_path / "ws"), group_size=64, dtype="float16", progress=False)
    engine = scoring_engine(str(ws), seqlen=512, dtype="fp32", max_context_token_num=256)
    ids = _wikitext_ids(engine.tokenizer, 1024)
    ours = perplexity(engine_window_scorer(engine), ids, seqlen=512, progress=False).ppl
    ref = perplexity(hf_window_scorer(reference), ids, seqlen=512, progress=False).ppl
    print(f"int4 ppl: engine {ours:.4f} vs dequantized HF {ref:.4f}")
    # spread, 8 windows x 2 package sets + 4 windows x AVX2/default CPU kernels: -0.040..+0.034 %; bound 0.5 % (12x)
    assert abs(ours - ref) / ref < 0.005


def test_kv_int8_online_ppl_close_to_float_kv(smol_ws):
    from lmd.eval.ppl import perplexity
    from lmd.turbomind.window_scorer import engine_window_scorer, scoring_engine

    float_kv = scoring_engine(str(smol_ws), seqlen=512)
    ids = _wikitext_ids(float_kv.tokenizer, 1024)
    base = perplexity(engine_window_scorer(float_kv), ids, seqlen=512, progress=False).ppl
    int8 = scoring_engine(str(smol_ws), seqlen=512, quant_policy=4)
    assert int8.runner.cache.k[0].dtype == torch.int8 and not int8.runner.kv_int8_static
    ppl = perplexity(engine_window_scorer(int8), ids, seqlen=512, progress=False).ppl
    print(f"KV int8 online ppl {ppl:.4f} vs float KV {base:.4f}")
    # spread, 8 windows x 2 package sets + 4 windows x AVX2/default CPU kernels: +0.035..+0.39 % (CI +0.36 %); bound
    # 1 % (2.6x). A 4-bit step gives +9 %, a dropped zero point +16,000 %; a 6-bit step (+0.32 %) or floor for round
    # (+0.11 %) hide in the spread, so test_kv_int8.py checks the step and the rounding exactly.
    assert abs(ppl - base) / base < 0.01


@pytest.mark.parametrize(("width", "length_penalty"), [(2, 1.0), (4, 0.6)])
def test_beam_search_matches_hf(smol_ws, hf_model, prompt_ids, width, length_penalty):
    from transformers import GenerationConfig as HFConfig

    from lmd.turbomind.gen_config import GenerationConfig

    engine = Engine(smol_ws, start=False, cache_block_seq_len=16, cache_max_entry_count=256)
    eos = list(engine.eos_ids)
    config = GenerationConfig(beam_width=width, n=2, length_penalty=length_penalty, max_new_tokens=24, temperature=0)
    searches = [engine.generate_samples(ids, config) for ids in prompt_ids]  # all eight in one batch
    while engine.step():
        pass
    hf_config = HFConfig(num_beams=width, num_return_sequences=2, do_sample=False, length_penalty=length_penalty,
                         max_new_tokens=24, eos_token_id=eos, pad_token_id=eos[0])
    for ids, streams in zip(prompt_ids, searches, strict=True):
        out = hf_model.generate(torch.tensor([ids]), generation_config=hf_config)[:, len(ids):].tolist()
        expected = [row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in out]
        assert [s.result().token_ids for s in streams] == expected
    stats = engine.stats()
    assert stats.blocks_used == 0 and stats.blocks_free == 256
