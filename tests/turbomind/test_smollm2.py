"""SmolLM2-135M-Instruct (fp32 workspace deployed from the GGUF) on CPU: greedy output token-identical to HF generate.

LMD_ENGINE_TOKENS sets the generation length (16 in CI; the closing measurement used 64).
"""

from __future__ import annotations

import os

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

    return deploy("hf", str(smollm2_gguf), str(tmp_path_factory.mktemp("smol") / "ws"), dtype="float32",
                  progress=False)


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
    assert worst < 1e-3
