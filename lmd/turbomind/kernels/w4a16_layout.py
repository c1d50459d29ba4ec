"""The engine's int4 weight layout (W4A16), and conversion from AutoAWQ's "gemm" tensors.

A linear y = x @ W.T with W of shape [N, K] (out, in) is stored as three tensors:

    qweight  int32 [K // 8, N]   eight 4-bit codes along K per int32, N contiguous
    scales   act   [K // g, N]   per (group of g input channels, output channel)
    zeros    act   [K // g, N]   the zero point folded in: zeros = -z * scale

             n=0      n=1      ...  n=N-1
    row r  [ int32 ][ int32 ] ... [ int32 ]      row r holds k = 8r .. 8r+7
              |
              bits 4i..4i+3 = code of k = 8r + i   (i = 0..7, natural order, low nibble first)

    dequant:  W.T[k, n] = code(k, n) * scales[k // g, n] + zeros[k // g, n]      (one FMA)

Packing along K keeps a GEMV's loads coalesced over N and lets a GEMM tile K in multiples of 8 without
shuffling nibbles. AutoAWQ "gemm" tensors differ: qweight int32 [K, N // 8] packs eight *output* channels per int32
in the interleaved order [0, 2, 4, 6, 1, 3, 5, 7]; qzeros int32 [K // g, N // 8] likewise; scales fp16 [K // g, N].
"""

from __future__ import annotations

import torch

PACK = 8  # 4-bit codes per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds output column 8j + AWQ_ORDER[i]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_awq_int32(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, C // 8] (interleaved along columns) -> uint4 codes as int32 [R, C] in natural column order."""
    rows, cols8 = packed.shape
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [R, C/8, 8]: nibble i -> col AWQ_ORDER[i]
    codes = torch.empty_like(nibbles)
    codes[..., list(AWQ_ORDER)] = nibbles
    return codes.reshape(rows, cols8 * PACK)


def pack_awq_int32(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of unpack_awq_int32: codes int [R, C] in 0..15 -> AWQ int32 [R, C // 8]."""
    rows, cols = codes.shape
    grouped = codes.to(torch.int32).reshape(rows, cols // PACK, PACK)[..., list(AWQ_ORDER)]
    return _or_nibbles(grouped)


def pack_codes_along_k(codes_kn: torch.Tensor) -> torch.Tensor:
    """codes int [K, N] (0..15) -> engine qweight int32 [K // 8, N]."""
    k, n = codes_kn.shape
    if k % PACK:
        raise ValueError(f"K={k} must be a multiple of {PACK} to pack int4 along K")
    grouped = codes_kn.to(torch.int32).reshape(k // PACK, PACK, n)  # [K/8, 8, N]: slices stay contiguous along N
    out = torch.zeros((k // PACK, n), dtype=torch.int32, device=codes_kn.device)
    for i in range(PACK):
        out |= grouped[:, i, :] << (4 * i)
    return out


def unpack_codes_along_k(qweight: torch.Tensor) -> torch.Tensor:
    """Engine qweight int32 [K // 8, N] -> codes int32 [K, N]."""
    k8, n = qweight.shape
    nibbles = (qweight.unsqueeze(1) >> _SHIFTS.to(qweight.device).view(1, PACK, 1)) & 0xF  # [K/8, 8, N]
    return nibbles.reshape(k8 * PACK, n)


def _or_nibbles(grouped: torch.Tensor) -> torch.Tensor:
    """grouped int32 [..., 8] of 4-bit codes -> int32 [...], code i at bits 4i (wraps into the sign bit on purpose)."""
    out = torch.zeros(grouped.shape[:-1], dtype=torch.int32, device=grouped.device)
    for i in range(PACK):
        out |= grouped[..., i] << (4 * i)
    return out


def awq_to_engine(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                  dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ gemm (qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N]) -> engine (qweight, scales, zeros)."""
    codes = unpack_awq_int32(qweight)  # [K, N]
    k = codes.shape[0]
    if k % group_size or scales.shape[0] != k // group_size:
        raise ValueError(f"AWQ tensors with K={k} do not match group_size={group_size} (scales rows {scales.shape[0]})")
    z = unpack_awq_int32(qzeros).to(torch.float32)
    s = scales.to(torch.float32)
    return pack_codes_along_k(codes), s.to(dtype), (-z * s).to(dtype)


def engine_to_awq(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of awq_to_engine: engine (qweight [K/8, N], scales, zeros = -zero * scale) -> AutoAWQ gemm (qweight
    [K, N/8], qzeros [K/g, N/8], scales [K/g, N] fp16). The integer zeros are recovered by rounding
    -zeros / scales, exact for zeros the engine made from integers (any AWQ or RTN checkpoint)."""
    codes = unpack_codes_along_k(qweight)
    zero = torch.round(-zeros.float() / scales.float()).clamp(0, 15).to(torch.int32)
    return pack_awq_int32(codes), pack_awq_int32(zero), scales.to(torch.float16).contiguous()


def quantize_to_engine(weight: torch.Tensor, group_size: int, dtype: torch.dtype = torch.float16
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric int4 of a dense W [N, K] straight into the engine layout (tests, benchmarks)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    w = weight.to(torch.float32).t().reshape(k // group_size, group_size, n)
    wmax, wmin = w.amax(dim=1), w.amin(dim=1)
    scale = ((wmax - wmin).clamp(min=1e-5) / 15.0)
    zero = torch.round(-wmin / scale).clamp(0, 15)
    codes = torch.clamp(torch.round(w / scale.unsqueeze(1)) + zero.unsqueeze(1), 0, 15).reshape(k, n)
    return pack_codes_along_k(codes.to(torch.int32)), scale.to(dtype), (-zero * scale).to(dtype)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Engine layout -> dense W.T [K, N] in the scales' dtype (computed in fp32). The reference for every kernel."""
    codes = unpack_codes_along_k(qweight).to(torch.float32)
    k = codes.shape[0]
    group = k // scales.shape[0]
    s = scales.to(torch.float32).repeat_interleave(group, dim=0)
    z = zeros.to(torch.float32).repeat_interleave(group, dim=0)
    return (codes * s + z).to(scales.dtype)


def w4a16_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                           zeros: torch.Tensor) -> torch.Tensor:
    """y = x @ dequant(W).T with fp32 accumulation; x [..., K] -> y [..., N] in x's dtype."""
    w = dequantize(qweight, scales.to(torch.float32), zeros.to(torch.float32))
    return (x.to(torch.float32) @ w).to(x.dtype)
