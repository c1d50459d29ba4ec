"""Read one int4 linear of an AWQ, GPTQ or compressed-tensors checkpoint into the engine layout (`Int4Linear`).

Each reader checks the tensors' presence and shapes against config.json (a one-line error naming the tensor), then
converts: AWQ through `awq_to_engine`, GPTQ and pack-quantized through `Int4Codes` and `to_engine`. Nothing is
re-quantized.
"""

from __future__ import annotations

import torch

from lmd.deploy.gptq_tensors import gptq_codes, pack_quantized_codes
from lmd.deploy.int4_codes import Int4Codes, to_engine
from lmd.deploy.int4_schemes import Int4Scheme
from lmd.deploy.linears import Int4Linear
from lmd.deploy.source_weights import TensorReader
from lmd.errors import LmdError
from lmd.turbomind.kernels.w4a16_layout import awq_to_engine

QUANTIZED_WEIGHT = {"awq": "qweight", "gptq": "qweight", "compressed-tensors": "weight_packed"}


def read_int4_linear(reader: TensorReader, scheme: Int4Scheme, module: str, n: int, k: int, group_size: int,
                     dtype: torch.dtype) -> Int4Linear:
    where = reader.where
    if reader.has(f"{module}.weight") and not reader.has(f"{module}.{QUANTIZED_WEIGHT[scheme.fmt]}"):
        raise LmdError(f"{where}: {module} is not quantized (it has .weight, not .{QUANTIZED_WEIGHT[scheme.fmt]}); "
                       f"lmd deploy needs every q/k/v/o/gate/up/down linear in {scheme.fmt} int4")
    if n % 8 or k % 8:
        raise LmdError(f"{where}: {module} is [{n}, {k}]; int4 checkpoints need N and K multiples of 8")
    if scheme.fmt == "awq":
        g = group_size
        if k % g:
            raise LmdError(f"{where}: {module} is [{n}, {k}]; AWQ needs K % {g} == 0")
        qweight = reader.get(f"{module}.qweight", (k, n // 8))
        qzeros = reader.get(f"{module}.qzeros", (k // g, n // 8))
        scales = reader.get(f"{module}.scales", (k // g, n))
        return Int4Linear(*awq_to_engine(qweight, qzeros, scales, g, dtype))
    groups = 1 if scheme.group_size == -1 else -(-k // scheme.group_size)
    if scheme.group_size != -1 and k % scheme.group_size:
        raise LmdError(f"{where}: {module} has K={k}, not a multiple of group_size {scheme.group_size}; "
                       "the engine needs whole groups")
    codes = _gptq(reader, scheme, module, n, k, groups) if scheme.fmt == "gptq" else _pack_quantized(
        reader, module, n, k, groups, scheme.sym)
    try:
        engine = to_engine(codes, group_size, dtype)
    except ValueError as exc:
        raise LmdError(f"{where}: {module}: {exc}; the checkpoint's grouping is not one lmd can serve") from None
    return Int4Linear(engine.qweight, engine.scales, engine.zeros, engine.perm)


def _g_idx(reader: TensorReader, name: str, k: int) -> torch.Tensor | None:
    return reader.get(name, (k,)) if reader.has(name) else None


def _gptq(reader: TensorReader, scheme: Int4Scheme, module: str, n: int, k: int, groups: int) -> Int4Codes:
    qweight = reader.get(f"{module}.qweight", (k // 8, n))
    qzeros = reader.get(f"{module}.qzeros", (groups, n // 8))
    scales = reader.get(f"{module}.scales", (groups, n))
    return gptq_codes(qweight, qzeros, scales, _g_idx(reader, f"{module}.g_idx", k), scheme.zeros_minus_one)


def _pack_quantized(reader: TensorReader, module: str, n: int, k: int, groups: int, sym: bool) -> Int4Codes:
    if reader.has(f"{module}.weight_shape"):
        shape = [int(v) for v in reader.get(f"{module}.weight_shape").reshape(-1).tolist()]
        if shape != [n, k]:
            raise LmdError(f"{reader.where}: {module}.weight_shape is {shape} but config.json implies {[n, k]}")
    packed = reader.get(f"{module}.weight_packed", (n, k // 8))
    scale = reader.get(f"{module}.weight_scale", (n, groups))
    zero_point = None if sym else reader.get(f"{module}.weight_zero_point", (n // 8, groups))
    return pack_quantized_codes(packed, scale, zero_point, _g_idx(reader, f"{module}.weight_g_idx", k))
