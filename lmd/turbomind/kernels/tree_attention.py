"""Tree attention over the paged KV cache (speculative token trees): the Triton kernel and its checked launch.

`tree_attention_triton(q, k, v, meta, row_masks, scale)` computes what `lmd.turbomind.tree_attention.
tree_attention_reference` computes (the CPU path and the tests' oracle). The batch is laid out as for paged attention
(`kernels/attention_meta.attention_meta`): sequence i owns rows [q_starts[i], q_starts[i] + n) of q, whose K/V are
already stored at positions [ctx - n, ctx) of the sequence (the tree flattened, parents first). Instead of the causal
mask, row j of a chunk sees every cached key before the chunk (positions < ctx - n) and the chunk's key i iff bit i
of row_masks[row] is set (its ancestors and itself: `speculative/tree.TokenTree.row_masks`), so n <= 64.

    q          [T, Hq, D]                        fp16, bf16 or fp32
    k, v       [num_blocks, block_size, Hkv, D]  one layer's pools, in q's dtype (int8 KV: the reference)
    row_masks  [T] int64                         on q's device

One program per (query token, KV head): the GQA group's query heads as rows of one tile (padded to 16 for tl.dot),
keys in BLOCK_N steps through the block table, online softmax in the exp2 domain with fp32 accumulators, P rounded
to the compute dtype before P @ V (as the paged kernels). Tree chunks are short, so a program per token is enough.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.attention_config import LOG2E, unsupported_reason
from lmd.turbomind.kernels.attention_meta import AttentionMeta, attention_meta
from lmd.turbomind.kernels.host_copy import to_device

__all__ = ["MAX_TREE_ROWS", "attention_meta", "tree_attention_triton", "unsupported_reason"]

MAX_TREE_ROWS = 64


@triton.jit
def _tree_attention_kernel(
    q_ptr, out_ptr, k_ptr, v_ptr, tables_ptr, seq_info_ptr, token_seq_ptr, masks_ptr, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_tab, stride_cb, stride_ct, stride_ch,
    GROUP: tl.constexpr, G_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(token_seq_ptr + token)
    n = tl.load(seq_info_ptr + seq * 3 + 1)
    ctx = tl.load(seq_info_ptr + seq * 3 + 2)
    prefix = ctx - n
    row_mask = tl.load(masks_ptr + token)

    rows = tl.arange(0, G_ROWS)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + rows
    q_off = token.to(tl.int64) * stride_qt + heads[:, None].to(tl.int64) * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=rows[:, None] < GROUP, other=0.0)

    m_i = tl.full([G_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([G_ROWS], tl.float32)
    acc = tl.zeros([G_ROWS, HEAD_DIM], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_tab
    for start in range(0, ctx, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < ctx
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_off = (block * stride_cb + (keys % BLOCK_SIZE).to(tl.int64) * stride_ct + kv_head * stride_ch)[:, None] \
            + dims[None, :]
        k = tl.load(k_ptr + kv_off, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=key_ok[:, None], other=0.0)
        rel = tl.maximum(keys - prefix, 0).to(tl.int64)
        in_tree = ((row_mask >> rel) & 1) == 1
        visible = key_ok & ((keys < prefix) | in_tree)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        qk = tl.where(visible[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with no visible key adds nothing
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(qk - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    o_off = token.to(tl.int64) * stride_ot + heads[:, None].to(tl.int64) * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < GROUP)


def tree_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                          row_masks: torch.Tensor, q_lens: list[int], scale: float,
                          block_n: int = 32) -> torch.Tensor:
    """q [T, Hq, D] over one layer's float pools k, v with each row's tree mask -> out [T, Hq, D] in q's dtype.
    q_lens: the chunk length of each sequence (host ints, as in meta)."""
    reason = unsupported_reason(q, k.dtype)
    if reason is not None:
        raise ValueError(f"tree_attention_triton: unsupported {reason}")
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} should be [blocks, block_size, Hkv, D] alike")
    t, num_heads, d = q.shape
    if t != meta.num_tokens or d != k.shape[3] or num_heads % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit {meta.num_tokens} tokens over K/V {tuple(k.shape)}")
    if row_masks.shape != (t,) or row_masks.dtype != torch.int64 or row_masks.device != q.device:
        raise ValueError(f"row_masks should be [{t}] int64 on {q.device}")
    if max(q_lens, default=0) > MAX_TREE_ROWS:
        raise ValueError(f"a tree chunk of {max(q_lens)} rows: at most {MAX_TREE_ROWS} (one int64 mask per row)")
    if q.stride(2) != 1 or k.stride() != v.stride() or k.stride(3) != 1:
        raise ValueError("q, k and v need a contiguous head dim, and k and v the same strides")
    out = torch.empty_like(q)
    if t == 0:
        return out
    group = num_heads // k.shape[2]
    token_seq = to_device([i for i, n in enumerate(q_lens) for _ in range(n)], torch.int32, q.device)
    _tree_attention_kernel[(t, k.shape[2])](
        q, out, k, v, meta.tables, meta.seq_info, token_seq, row_masks, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.tables.stride(0), *k.stride()[:3],
        GROUP=group, G_ROWS=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, HEAD_DIM=d,
        BLOCK_SIZE=k.shape[1], DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
