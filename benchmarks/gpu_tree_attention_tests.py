"""The tree-attention Triton kernel on a GPU against its PyTorch reference, at Llama shapes, fp16 and bf16 (CI checks
it under the interpreter on small fp32/fp16 shapes only), then its time beside causal paged attention of the same
rows (issue 17: the cost of 16- and 32-token trees).

    python3 benchmarks/gpu_tree_attention_tests.py

Each case fills a paged cache (pool poisoned with NaN, block ids shuffled) through KVCache.write with every
sequence's cached prefix and its tree, random trees of `rows` tokens (`TokenTree.row_masks`). Error = max |kernel -
reference| against the reference's own bf16/fp16 rounding bound. Exits 1 on any failure; writes
$OUT/gpu_tree_attention_tests.json when OUT is set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmd.turbomind.forward_batch import ForwardBatch  # noqa: E402
from lmd.turbomind.kernels.paged_attention import attention_meta  # noqa: E402
from lmd.turbomind.kernels.tree_attention import tree_attention_triton  # noqa: E402
from lmd.turbomind.kv_cache import KVCache  # noqa: E402
from lmd.turbomind.speculative.tree import TokenTree  # noqa: E402
from lmd.turbomind.tree_attention import tree_attention_reference  # noqa: E402

TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
# (name, (tree rows, cached tokens) per sequence, q heads, kv heads, head dim)
CASES = (
    ("7b-mha-b1-16", ((16, 512),), 32, 32, 128),
    ("7b-mha-b1-32", ((32, 512),), 32, 32, 128),
    ("7b-mha-b16-16", tuple((16, 300 + 13 * i) for i in range(16)), 32, 32, 128),
    ("8b-gqa-b4-32", tuple((32, 700 + 50 * i) for i in range(4)), 32, 8, 128),
    ("smol-gqa3-b2-9", ((9, 40), (9, 1)), 9, 3, 64),
)


def random_masks(rows: int, gen: torch.Generator) -> list[int]:
    parents = tuple(int(torch.randint(-1, i, (1,), generator=gen)) for i in range(rows - 1))
    return TokenTree(tuple(range(rows - 1)), parents).row_masks()


def build(seqs, q_heads: int, kv_heads: int, d: int, dtype: torch.dtype, block_size: int = 64):
    gen, dev = torch.Generator().manual_seed(len(seqs) * 7 + q_heads), torch.device("cuda")
    need = [-(-(n + start) // block_size) for n, start in seqs]
    num_blocks = sum(need) + 3
    cache = KVCache(1, num_blocks, block_size, kv_heads, d, dtype, dev)
    cache.k[0].fill_(float("nan"))
    cache.v[0].fill_(float("nan"))
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, masks = [], []
    for (n, start), count in zip(seqs, need, strict=True):
        table, ids = ids[:count], ids[count:]
        chunks.append((list(range(n)), start, table))
        masks += random_masks(n, gen)
        whole = ForwardBatch.build([(list(range(start + n)), 0, table)], block_size, [], dev)
        cache.write(0, (torch.randn(start + n, kv_heads, d, generator=gen) * 2).to(dev, dtype),
                    torch.randn(start + n, kv_heads, d, generator=gen).to(dev, dtype), whole.slots)
    batch = ForwardBatch.build(chunks, block_size, [], dev)
    q = torch.randn(batch.num_tokens, q_heads, d, generator=gen).to(dev, dtype)
    return cache, batch, q, torch.tensor(masks, dtype=torch.int64, device=dev)


def time_us(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def check(name: str, seqs, hq: int, hkv: int, d: int, dtype: torch.dtype) -> dict:
    from lmd.turbomind.paged_attention import paged_attention

    cache, batch, q, masks = build(seqs, hq, hkv, d, dtype)
    scale = d**-0.5
    ref = tree_attention_reference(q, cache, 0, batch, masks, scale).float()
    meta = attention_meta(batch.q_starts, batch.q_lens, batch.ctx_lens, batch.block_tables, q.device)

    def tree() -> torch.Tensor:
        return tree_attention_triton(q, cache.k[0], cache.v[0], meta, masks, list(batch.q_lens), scale)

    err = (tree().float() - ref).abs().max().item()
    return dict(case=name, dtype=str(dtype).removeprefix("torch."), max_err=err,
                ok=err <= TOL[dtype] * max(1.0, ref.abs().max().item()), tree_us=time_us(tree),
                causal_paged_us=time_us(lambda: paged_attention(q, cache, 0, batch, scale)))


def main() -> None:
    results = []
    for case in CASES:
        for dtype in (torch.float16, torch.bfloat16):
            results.append(check(*case, dtype))
            print(results[-1], flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_tree_attention_tests.json").write_text(json.dumps(results, indent=1))
    print("\ncase              dtype     max err   ok   tree µs  causal paged µs")
    for r in results:
        print(f"{r['case']:<17} {r['dtype']:<8} {r['max_err']:>8.1e}  {r['ok']!s:<5} {r['tree_us']:>7.1f}  "
              f"{r['causal_paged_us']:>15.1f}")
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
