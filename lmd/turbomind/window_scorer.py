"""Perplexity scoring through the engine's model: a window runs in prefill chunks over the paged KV cache.

`score(ids)` returns the summed NLL of ids[1:] (the `score_window` contract of `lmd.eval.ppl.perplexity`). The
window borrows unhashed blocks from the engine's block manager and gives them back, so it never enters the prefix
cache; the engine must not be serving at the same time (build it with `start=False`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lmd.errors import LmdError
from lmd.turbomind.engine import Engine
from lmd.turbomind.workspace import open_workspace

LOGIT_ROWS = 512  # logits are materialised this many rows at a time (a 2048 x 49k fp32 block is 400 MB)


def engine_window_scorer(engine: Engine) -> Callable[[torch.Tensor], float]:
    runner, blocks_of = engine.runner, engine.block_manager
    chunk_tokens = engine.workspace.engine.max_context_token_num

    @torch.inference_mode()
    def score(ids: torch.Tensor) -> float:
        tokens = ids.reshape(-1).tolist()
        needed = blocks_of.blocks_for(len(tokens))
        if needed > blocks_of.num_free:
            raise LmdError(f"a window of {len(tokens)} tokens needs {needed} KV blocks, the pool has "
                           f"{blocks_of.num_free}; lower --seqlen or raise cache_max_entry_count")
        table = blocks_of.allocate_blocks(needed)
        total = 0.0
        try:
            for start in range(0, len(tokens), chunk_tokens):
                piece = tokens[start:start + chunk_tokens]
                targets = torch.tensor(tokens[start + 1:start + 1 + len(piece)], device=runner.device)
                hidden = runner.hidden_states(piece, start, table)[: len(targets)]
                for row in range(0, len(targets), LOGIT_ROWS):
                    logits = runner.model.logits(hidden[row:row + LOGIT_ROWS])
                    total += float(F.cross_entropy(logits, targets[row:row + LOGIT_ROWS], reduction="sum"))
        finally:
            blocks_of.release_blocks(table)
        return total

    return score


def scoring_engine(workspace: str, seqlen: int, device: str = "auto", dtype: str = "auto", **overrides) -> Engine:
    """An engine sized for one window of `seqlen` tokens, with no serving loop."""
    block = open_workspace(workspace, **overrides).engine.cache_block_seq_len
    options = dict(max_batch_size=1, session_len=seqlen + 1, cache_max_entry_count=max(2, -(-seqlen // block) + 1),
                   device=device, dtype=dtype)
    options.update(overrides)
    return Engine(workspace, start=False, **options)
