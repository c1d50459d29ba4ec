"""SmolLM2-135M-Instruct fp32 (GQA 9/3 heads, 30 layers) with token trees: greedy output token-identical to HF
generate on the chat prompts of test_smollm2.py, one at a time and batched, the pools full again."""

from __future__ import annotations

import pytest

from lmd.turbomind.engine import Engine
from lmd.turbomind.speculative.config import SpeculativeConfig
from lmd.turbomind.speculative.layer_draft import first_layers_workspace
from tests.turbomind.test_smollm2 import _run, hf_model, hf_outputs, prompt_ids, smol_ws  # noqa: F401

pytestmark = pytest.mark.slow


def test_greedy_with_token_trees_matches_hf(smol_ws, prompt_ids, hf_outputs, tmp_path):  # noqa: F811
    draft = first_layers_workspace(smol_ws, 8, tmp_path / "draft")  # the first 8 of 30 layers and the head
    for speculative in (SpeculativeConfig("ngram", tree=(3, 3), prompt_lookup_min=1),
                        SpeculativeConfig("draft", model=str(draft), tree=(2, 3))):
        engine = Engine(smol_ws, start=False, cache_block_seq_len=16, cache_max_entry_count=256,
                        speculative=speculative)
        assert [_run(engine, [ids])[0] for ids in prompt_ids] == hf_outputs
        assert _run(engine, prompt_ids) == hf_outputs
        stats = engine.stats()
        assert stats.spec_accepted_tokens > 0 and stats.blocks_used == 0
        assert engine.speculator.drafter is None or engine.speculator.drafter.block_manager.num_used == 0
