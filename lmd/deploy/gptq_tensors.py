"""GPTQ (AutoGPTQ / GPTQModel) and compressed-tensors `pack-quantized` int4 tensors -> `Int4Codes`.

GPTQ, for W [N, K] (the layout the engine's qweight shares):

    qweight  int32 [K/8, N]   nibble i of row r = code of input channel 8r + i
    qzeros   int32 [G, N/8]   nibble i of column j = zero point of output channel 8j + i
    scales   fp16  [G, N]
    g_idx    int32 [K]        group of each input channel (k // group_size unless act-order)

Checkpoint format "gptq" (v1, AutoGPTQ and GPTQModel's default save) stores the zero points minus one: GPTQModel's
v2->v1 save subtracts 0x11111111 from each qzeros int32 *as one integer* (a zero of 0 borrows from the next nibble), so
its loader adds 0x11111111 back the same way; we do that, modulo 2**32. "gptq_v2" stores them as they are. Symmetric
checkpoints hold z = 8 (0x77777777 in v1).

compressed-tensors pack-quantized (llm-compressor W4A16), for W [N, K]:

    weight_packed      int32 [N, K/8]   nibble i of column c = input channel 8c + i; value q + 8 (q signed, -8..7)
    weight_scale       [N, G]
    weight_zero_point  int32 [N/8, G]   asymmetric only; nibble i of row r = output channel 8r + i; value zp + 8
    weight_g_idx       int32 [K]        actorder=group only

W = (q - zp) * s; both carry the same +8 offset, so the unsigned nibbles give the same difference (symmetric: z = 8).
"""

from __future__ import annotations

import torch

from lmd.deploy.int4_codes import Int4Codes, unpack_nibbles

V1_ZERO_OFFSET = 0x11111111


def trivial_g_idx(k: int, groups: int) -> torch.Tensor:
    return torch.arange(k, dtype=torch.int64) // (k // groups)


def gptq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               zeros_minus_one: bool) -> Int4Codes:
    packed_zeros = qzeros.to(torch.int64)
    if zeros_minus_one:
        packed_zeros = (packed_zeros + V1_ZERO_OFFSET) & 0xFFFFFFFF
    zeros = unpack_nibbles(packed_zeros.to(torch.int64), dim=1)
    codes = unpack_nibbles(qweight, dim=0)
    groups = scales.shape[0]
    idx = trivial_g_idx(codes.shape[0], groups) if g_idx is None else g_idx.to(torch.int64)
    return Int4Codes(codes, scales.float(), zeros.float(), idx)


def pack_quantized_codes(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                         weight_zero_point: torch.Tensor | None, g_idx: torch.Tensor | None) -> Int4Codes:
    codes = unpack_nibbles(weight_packed, dim=1).t().contiguous()  # [K, N]
    scales = weight_scale.float().t().contiguous()  # [G, N]
    if weight_zero_point is None:
        zeros = torch.full_like(scales, 8.0)
    else:
        zeros = unpack_nibbles(weight_zero_point, dim=0).float().t().contiguous()
    idx = trivial_g_idx(codes.shape[0], scales.shape[0]) if g_idx is None else g_idx.to(torch.int64)
    return Int4Codes(codes, scales, zeros, idx)
