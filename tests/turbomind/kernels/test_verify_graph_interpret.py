"""Verification steps on the graphs' static buffers with the Triton attention (Triton's CPU interpreter): the prefill
kernel reads the T > 1 metadata of `paged_attention.decode_graph_meta` (seq_info refilled per step, tiles fixed per
bucket), and a tiny model's logits equal the reference path's on the plain batch. T = 5 (one tile per sequence) and
T = 21 (fp32 tiles of 16 query tokens: a second tile partly or wholly past a chunk's end); chunks of K, fewer and no
proposals; three sequences in bucket 4 (a padding sequence); every block outside the tables (the scratch block too)
poisoned with NaN. This file runs as a script in a fresh process (tests/turbomind/kernels/conftest.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.turbomind.kernels.interpreter import run_jobs

STEPS = {5: (5, 3, 1), 21: (18, 3, 1)}  # T -> tokens each sequence computes in the step


def verify_logits(ws: str, tokens: int) -> float:
    """Largest |graph buffers - reference| logit of one step, over the reference logits' range."""
    import torch

    from lmd.turbomind.model_runner import ModelRunner
    from lmd.turbomind.scheduler import ScheduledChunk, SchedulerOutput
    from lmd.turbomind.workspace import open_workspace

    runner = ModelRunner(open_workspace(ws, cache_block_seq_len=16, cache_max_entry_count=16, max_batch_size=4,
                                        session_len=128))
    ids = torch.randint(0, 49152, (80,), generator=torch.Generator().manual_seed(tokens)).tolist()
    tables, starts = [[9, 2, 14], [5, 0, 11], [7]], [20, 35, 3]
    seqs = [ids[: 20 + STEPS[tokens][0]], ids[40:40 + 35 + 3], ids[78:80] + ids[:2]]
    runner.run_chunks([(s[:start], 0, t) for s, start, t in zip(seqs, starts, tables, strict=True)], [])
    used = {b for t in tables for b in t}
    for layer in range(len(runner.cache.k)):
        for b in set(range(runner.cache.num_blocks)) - used:
            runner.cache.k[layer][b].fill_(float("nan"))
            runner.cache.v[layer][b].fill_(float("nan"))
    chunks = tuple(ScheduledChunk(i, tuple(s[start:]), start, tuple(t), True, num_draft=len(s) - start - 1)
                   for i, (s, start, t) in enumerate(zip(seqs, starts, tables, strict=True)))
    assert [len(c.token_ids) for c in chunks] == list(STEPS[tokens])
    rows = list(range(sum(STEPS[tokens])))
    ref = runner.run_chunks([(list(c.token_ids), c.start, list(c.block_table)) for c in chunks], rows)
    runner.enable_decode_graphs(capture=False)
    runner.enable_verify_graphs(tokens)
    os.environ["LMD_ATTENTION"] = "triton"
    try:
        out = runner.run(SchedulerOutput(chunks, ()))
    finally:
        os.environ["LMD_ATTENTION"] = "reference"
    assert torch.isfinite(out).all()
    return ((out - ref).abs().max() / (ref.amax() - ref.amin())).item()


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    json.dump(run_jobs({f"T={t}": (lambda t=t: verify_logits(sys.argv[1], t)) for t in STEPS}), sys.stdout)


@pytest.mark.parametrize("tokens", list(STEPS))
def test_verification_graph_buffers_match_the_reference(interpreted: dict, tokens: int) -> None:
    err = interpreted[f"T={tokens}"]
    assert isinstance(err, float), err
    assert err < 1e-5, f"T={tokens}: logits differ by {err:.2e} of their range"
