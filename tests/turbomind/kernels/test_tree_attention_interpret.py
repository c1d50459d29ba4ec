"""The tree-attention Triton kernel (Triton's CPU interpreter, small shapes, fp32/fp16) against
tree_attention_reference, and the reference's own meaning on CPU: a chain's masks give causal paged attention, and a
row's output depends on its ancestors' keys only.

The interpreter cases run in one fresh process (this file run as a script, as test_paged_attention_interpret.py):
each fills a paged cache (the pool poisoned with NaN, block ids shuffled) through KVCache.write.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import dataclass

import pytest

from tests.turbomind.kernels.interpreter import run_jobs

TOL = {"fp32": 2e-5, "fp16": 4e-3}


@dataclass(frozen=True)
class Case:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (tree rows: root + nodes, cached tokens before them) per sequence
    dtype: str = "fp32"
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 16
    block_n: int = 32


CASES = (
    Case("trees-gqa2", ((9, 21), (5, 0), (13, 40))),
    Case("trees-gqa4-bs4-bn16", ((7, 3), (17, 30)), q_heads=8, block_size=4, block_n=16),
    Case("trees-mha-fp16-d64", ((11, 17), (3, 64)), "fp16", q_heads=2, head_dim=64),
    Case("tree-64-rows-fp16", ((64, 37),), "fp16", block_size=8),
)


def _tree_masks(rows: int, gen) -> list[int]:
    """A random tree of rows - 1 nodes below the root, parents first: each row's visibility bits."""
    import torch

    from lmd.turbomind.speculative.tree import TokenTree

    parents = tuple(int(torch.randint(-1, i, (1,), generator=gen)) for i in range(rows - 1))
    return TokenTree(tuple(range(rows - 1)), parents).row_masks()


def build(case: Case, gen, dtype):
    """A cache holding every sequence's prefix and tree K/V in shuffled blocks, the batch, queries, row masks."""
    import torch

    from lmd.turbomind.forward_batch import ForwardBatch
    from lmd.turbomind.kv_cache import KVCache

    bs, hkv, d = case.block_size, case.kv_heads, case.head_dim
    need = [-(-(n + start) // bs) for n, start in case.seqs]
    num_blocks = sum(need) + 3
    cache = KVCache(1, num_blocks, bs, hkv, d, dtype, torch.device("cpu"))
    cache.k[0].fill_(float("nan"))
    cache.v[0].fill_(float("nan"))
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, masks = [], []
    for (n, start), count in zip(case.seqs, need, strict=True):
        table, ids = ids[:count], ids[count:]
        chunks.append((list(range(n)), start, table))
        masks += _tree_masks(n, gen)
        whole = ForwardBatch.build([(list(range(start + n)), 0, table)], bs, [], torch.device("cpu"))
        cache.write(0, (torch.randn(start + n, hkv, d, generator=gen) * 2).to(dtype),
                    torch.randn(start + n, hkv, d, generator=gen).to(dtype), whole.slots)
    batch = ForwardBatch.build(chunks, bs, [], torch.device("cpu"))
    q = torch.randn(batch.num_tokens, case.q_heads, d, generator=gen).to(dtype)
    return cache, batch, q, torch.tensor(masks, dtype=torch.int64)


def run_case(case: Case) -> float:
    import torch

    from lmd.turbomind.kernels.paged_attention import attention_meta
    from lmd.turbomind.kernels.tree_attention import tree_attention_triton
    from lmd.turbomind.tree_attention import tree_attention_reference

    dtype = {"fp32": torch.float32, "fp16": torch.float16}[case.dtype]
    cache, batch, q, masks = build(case, torch.Generator().manual_seed(zlib.crc32(case.name.encode())), dtype)
    scale = case.head_dim**-0.5
    ref = tree_attention_reference(q, cache, 0, batch, masks, scale).float()
    meta = attention_meta(batch.q_starts, batch.q_lens, batch.ctx_lens, batch.block_tables, q.device)
    out = tree_attention_triton(q, cache.k[0], cache.v[0], meta, masks, list(batch.q_lens), scale,
                                block_n=case.block_n)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(ref).all()
    return (out.float() - ref).abs().max().item()


def run_dispatched() -> float:
    """tree_attention() with LMD_ATTENTION=triton runs the kernel (the result differs from the reference's by
    fp16 rounding only; with the reference it would be 0, which the test refuses)."""
    import torch

    from lmd.turbomind.tree_attention import tree_attention, tree_attention_reference

    case = Case("dispatch", ((6, 10), (4, 0)), "fp16")
    cache, batch, q, masks = build(case, torch.Generator().manual_seed(5), torch.float16)
    os.environ["LMD_ATTENTION"] = "triton"
    out = tree_attention(q, cache, 0, batch, masks, 0.2)
    os.environ["LMD_ATTENTION"] = "reference"
    return (out.float() - tree_attention_reference(q, cache, 0, batch, masks, 0.2).float()).abs().max().item()


def main(_ws: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    jobs = {c.name: (lambda c=c: run_case(c)) for c in CASES} | {"dispatch": run_dispatched}
    json.dump(run_jobs(jobs), sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_matches_reference(interpreted: dict, case: Case) -> None:
    err = interpreted[case.name]
    assert isinstance(err, float), err
    assert err < TOL[case.dtype], f"{case.name}: max abs error {err:.2e}"


def test_dispatch_runs_the_kernel_when_asked(interpreted: dict) -> None:
    err = interpreted["dispatch"]
    assert isinstance(err, float), err
    assert 0 < err < TOL["fp16"]


def test_chain_masks_are_causal_paged_attention() -> None:
    import torch

    from lmd.turbomind.paged_attention import paged_attention_reference
    from lmd.turbomind.tree_attention import tree_attention_reference

    cache, batch, q, _ = build(Case("chain", ((7, 12), (5, 0), (1, 9))), torch.Generator().manual_seed(1),
                               torch.float32)
    chain = torch.tensor([(1 << (j + 1)) - 1 for n in batch.q_lens for j in range(n)], dtype=torch.int64)
    tree = tree_attention_reference(q, cache, 0, batch, chain, 0.3)
    causal = paged_attention_reference(q, cache, 0, batch, 0.3, fused=False)
    assert (tree - causal).abs().max() < 1e-5


def test_rows_see_their_ancestors_only() -> None:
    """Changing the K/V of a tree node changes exactly the rows that have it as an ancestor (or are it)."""
    import torch

    from lmd.turbomind.tree_attention import tree_attention_reference

    cache, batch, q, masks = build(Case("one", ((9, 6),)), torch.Generator().manual_seed(2), torch.float32)
    before = tree_attention_reference(q, cache, 0, batch, masks, 0.3)
    node_row = 4  # chunk row 4 sits at position 6 + 4 of the sequence
    slot = batch.block_tables[0][(6 + node_row) // 16] * 16 + (6 + node_row) % 16
    cache.k[0].view(-1, 2, 32)[slot] += 3.0
    after = tree_attention_reference(q, cache, 0, batch, masks, 0.3)
    changed = ((after - before).abs().amax(dim=(1, 2)) > 1e-6).tolist()
    assert changed == [bool(m >> node_row & 1) for m in masks.tolist()]
    assert sum(changed) >= 1
