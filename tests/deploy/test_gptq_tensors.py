"""GPTQ and compressed-tensors int4 tensors -> engine layout: dequantization equal to the hand-packed checkpoint's."""

from __future__ import annotations

import itertools

import pytest
import torch

from lmd.deploy.gptq_tensors import gptq_codes, pack_quantized_codes
from lmd.deploy.int4_codes import to_engine
from lmd.turbomind.kernels.w4a16_layout import dequantize, w4a16_matmul_reference
from tests.deploy.gptq_checkpoint import Scheme, gptq_tensors, pack_quantized_tensors, quantize

N, K = 48, 256


def _weight(seed: int = 0) -> torch.Tensor:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
    w[:8] = w[:8].abs() + 0.1  # all-positive rows: zero point 0, the v1 borrow case
    return w


def _codes(scheme: Scheme, q):
    if scheme.fmt == "gptq":
        t = gptq_tensors(q, scheme.v1)
        return gptq_codes(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], zeros_minus_one=scheme.v1)
    t = pack_quantized_tensors(q, scheme.sym, scheme.act_order)
    return pack_quantized_codes(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                t.get("weight_g_idx"))


SCHEMES = [Scheme("gptq", g, sym, act, v1) for g, sym, act, v1 in itertools.product((32, 64, 128, -1), (True, False),
                                                                                     (False, True), (True, False))]
SCHEMES += [Scheme("compressed-tensors", g, sym, act, False)
            for g, sym, act in itertools.product((32, 64, 128, -1), (True, False), (False, True))]


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_engine_layout_dequantizes_to_the_checkpoint(scheme):
    q = quantize(_weight(), scheme, seed=3)
    expected = q.dequantize()  # [N, K]
    if not scheme.sym:
        assert (q.zeros == 0).any()  # the borrow case is exercised
    codes = _codes(scheme, q)
    assert torch.equal(codes.dequantize(), expected)
    engine_group = 64 if scheme.group_size == -1 else scheme.group_size
    engine = to_engine(codes, engine_group, torch.float32)
    stored = dequantize(engine.qweight, engine.scales, engine.zeros)  # [K, N] in the stored channel order
    assert (engine.perm is not None) == (scheme.act_order and scheme.group_size != -1)
    natural = stored if engine.perm is None else torch.empty_like(stored).index_copy_(0, engine.perm.long(), stored)
    # the engine folds the zero as -z*s: q*s + (-z*s) vs (q - z)*s differ by float rounding only
    torch.testing.assert_close(natural.t(), expected, rtol=0, atol=1e-6)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    gathered = x if engine.perm is None else x[:, engine.perm.long()]
    torch.testing.assert_close(w4a16_matmul_reference(gathered, engine.qweight, engine.scales, engine.zeros),
                               x @ expected.t(), rtol=1e-5, atol=1e-5)


def test_hand_written_words():
    """One GPTQ word per tensor, written out: nibble i of a qweight word is input channel i; of a qzeros word, output
    channel i; v1 zeros are the v2 word minus 0x11111111 as one integer."""
    codes = torch.tensor([[(k + n) % 16 for n in range(8)] for k in range(8)])  # [K=8, N=8]
    qweight = torch.tensor([[sum(int(codes[k, n]) << (4 * k) for k in range(8)) for n in range(8)]], dtype=torch.int64)
    qweight = torch.where(qweight >= 2**31, qweight - 2**32, qweight).to(torch.int32)  # [1, 8]
    zeros = [0, 5, 15, 8, 1, 0, 3, 7]
    assert sum(z << (4 * i) for i, z in enumerate(zeros)) == 0x73018F50
    scales = torch.linspace(0.5, 1.2, 8)[None].half()
    for word, v1 in ((0x73018F50, False), (0x61F07E3F, True)):
        out = gptq_codes(qweight, torch.tensor([[word]], dtype=torch.int32), scales, None, zeros_minus_one=v1)
        assert torch.equal(out.codes, codes.to(torch.int32))
        assert out.zeros[0].tolist() == zeros
    # compressed-tensors: rows are output channels, packed along K; zero points packed along N
    packed = qweight.t().contiguous()  # [N=8, K/8=1]: word n holds channel k at bits 4k, the same words
    out = pack_quantized_codes(packed, scales.t().contiguous(), torch.tensor([[0x73018F50]], dtype=torch.int32), None)
    assert torch.equal(out.codes, codes.to(torch.int32)) and out.zeros[0].tolist() == zeros


def test_act_order_groups_of_unequal_size_are_refused():
    q = quantize(_weight(), Scheme(group_size=64, act_order=True))
    g_idx = q.g_idx.clone()
    g_idx[g_idx == 0] = 1  # group 1 now has 128 channels, group 0 none
    t = gptq_tensors(q, v1=False)
    codes = gptq_codes(t["qweight"], t["qzeros"], t["scales"], g_idx, zeros_minus_one=False)
    with pytest.raises(ValueError, match="exactly 64 input channels"):
        to_engine(codes, 64, torch.float16)
