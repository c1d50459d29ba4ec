"""int4 (W4A16) workspaces: an AWQ checkpoint deployed with lmd.deploy runs like its dequantized HF twin."""

from __future__ import annotations

import pytest
import torch

from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.model_runner import ModelRunner
from lmd.turbomind.window_scorer import engine_window_scorer, scoring_engine
from lmd.turbomind.workspace import open_workspace
from tests.turbomind.awq_checkpoint import write_awq_checkpoint


@pytest.fixture(scope="module")
def int4_ws(tiny_llama_ws, tmp_path_factory):
    from lmd.deploy.converter import deploy

    root = tmp_path_factory.mktemp("int4")
    reference = write_awq_checkpoint(tiny_llama_ws[0], root / "awq", group_size=64)
    ws = deploy("base", str(root / "awq"), str(root / "ws"), group_size=64, dtype="float16", progress=False)
    return ws, reference


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_int4_forward_matches_dequantized_hf(int4_ws, dtype):
    ws, reference = int4_ws
    runner = ModelRunner(open_workspace(ws, cache_block_seq_len=4, cache_max_entry_count=16, dtype=dtype))
    assert runner.model.layers[0].mlp.w13.__class__.__name__ == "Int4Linear"
    ids = list(range(100, 130))
    ours = runner.model.forward(ForwardBatch.build([(ids, 0, list(range(8)))], 4, list(range(30)), runner.device),
                                runner.cache)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    # the workspace folds zeros as -z*s in fp16 (docs/workspace.md): a rounding away from the exact (q - z) * s.
    # Over 10 id windows x 2 package sets: fp32 6.8e-4..1.4e-3, fp16 1.1e-3..1.7e-3; bounds 4e-3 / 5e-3 (2.8x / 2.9x);
    # int4 vs the float weights differ by 0.2
    assert (ours - ref).abs().max() < (4e-3 if dtype == "fp32" else 5e-3)


def test_engine_window_scorer_equals_hf_nll(int4_ws):
    import torch.nn.functional as F

    ws, reference = int4_ws
    engine = scoring_engine(str(ws), seqlen=40, dtype="fp32", max_context_token_num=16, cache_block_seq_len=4)
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(9))
    ours = engine_window_scorer(engine)(ids)
    with torch.no_grad():
        ref = F.cross_entropy(reference(ids[None]).logits[0, :-1], ids[1:], reduction="sum").item()
    assert abs(ours - ref) < 1e-3 * abs(ref)  # over 10 seeds x 2 package sets: 5e-7..4.4e-6 relative
    assert engine.stats().blocks_used == 0
