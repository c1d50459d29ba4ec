"""The rank layout: which TPs a model takes, and split/merge as exact inverses for float and int4 tensors."""

from __future__ import annotations

import pytest
import torch

from lmd.errors import LmdError
from lmd.workspace_format.rank_layout import RankShape, check_tp, merge_ranks, split_ranks, tp_values

SMOL = RankShape(head_num=9, kv_head_num=3, head_dim=64, inter_size=1536)  # SmolLM2-135M


def test_any_divisor_of_the_heads_is_a_tp():
    assert tp_values(SMOL) == [1, 3]
    assert tp_values(RankShape(32, 8, 128, 11008)) == [1, 2, 4, 8]
    assert tp_values(RankShape(12, 6, 64, 1536)) == [1, 2, 3, 6]
    # int4: each rank's row-split input (576/3 = 192, 1536/3 = 512) must hold whole groups
    assert tp_values(RankShape(9, 3, 64, 1536, group_size=64)) == [1, 3]
    assert tp_values(RankShape(9, 3, 64, 1536, group_size=128)) == [1]


def test_bad_tp_names_the_valid_ones():
    with pytest.raises(LmdError, match=r"^--tp 2 does not divide head_num=9, kv_head_num=3 and inter_size=1536; "
                                       r"use --tp 1, 3$"):
        check_tp(2, SMOL)
    with pytest.raises(LmdError, match=r"^tp 3: the row-split int4 inputs .* not multiples of group_size 128; use tp 1$"):
        check_tp(3, RankShape(9, 3, 64, 1536, group_size=128), flag="tp")
    with pytest.raises(LmdError, match="--tp 0 must be >= 1"):
        check_tp(0, SMOL)
    check_tp(3, SMOL)


def _whole(shape: RankShape, int4: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, d = 96, shape.head_dim
    qkv_n, q_k, inter = (shape.head_num + 2 * shape.kv_head_num) * d, shape.head_num * d, shape.inter_size
    out = {"tok_embeddings.weight": torch.randn(50, h, generator=g), "norm.weight": torch.randn(h, generator=g),
           "layers.0.attention_norm.weight": torch.randn(h, generator=g),
           "layers.0.attention.w_qkv.bias": torch.randn(qkv_n, generator=g)}
    linears = {"attention.w_qkv": (qkv_n, h), "attention.wo": (h, q_k), "feed_forward.w13": (2 * inter, h),
               "feed_forward.w2": (h, inter)}
    for name, (n, k) in linears.items():
        if int4:
            gs = shape.group_size
            out[f"layers.0.{name}.qweight"] = torch.randint(0, 2**31 - 1, (k // 8, n), generator=g, dtype=torch.int32)
            out[f"layers.0.{name}.scales"] = torch.rand(k // gs, n, generator=g)
            out[f"layers.0.{name}.zeros"] = torch.randn(k // gs, n, generator=g)
        else:
            out[f"layers.0.{name}.weight"] = torch.randn(n, k, generator=g)
    return out


@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 3, 6])
def test_split_then_merge_is_the_identity(int4, tp):
    shape = RankShape(12, 6, 16, 96, group_size=16 if int4 else 0)
    whole = _whole(shape, int4)
    ranks = [split_ranks(whole, shape, tp, r) for r in range(tp)]
    merged = merge_ranks(ranks, shape)
    assert set(merged) == set(whole)
    for name, tensor in whole.items():
        assert torch.equal(merged[name], tensor), name


def test_a_rank_holds_its_own_heads_in_q_k_v_order():
    shape = RankShape(6, 3, 2, 12)
    d, h = 2, 4
    q = torch.arange(6 * d).repeat_interleave(h).view(6 * d, h).float()  # row i of q holds value i
    k, v = q[: 3 * d] + 100, q[: 3 * d] + 200
    rank1 = split_ranks({"layers.0.attention.w_qkv.weight": torch.cat([q, k, v])}, shape, 3, 1)
    rows = rank1["layers.0.attention.w_qkv.weight"][:, 0].tolist()
    # rank 1 of 3: q heads 2, 3 (rows 4..7), k head 1 (rows 2, 3), v head 1
    assert rows == [4, 5, 6, 7, 102, 103, 202, 203]


def test_row_split_cuts_k_and_keeps_the_bias_whole():
    shape = RankShape(4, 2, 4, 8)
    wo = torch.arange(3 * 16).view(3, 16).float()  # [H=3, K=16]
    bias = torch.arange(3.0)
    parts = [split_ranks({"layers.1.attention.wo.weight": wo, "layers.1.attention.wo.bias": bias}, shape, 2, r)
             for r in range(2)]
    assert torch.equal(parts[1]["layers.1.attention.wo.weight"], wo[:, 8:])
    assert torch.equal(parts[1]["layers.1.attention.wo.bias"], bias)
