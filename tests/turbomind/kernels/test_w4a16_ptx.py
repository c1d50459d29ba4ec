"""The W4A16 kernels' PTX decode blocks, executed here instruction by instruction on random words: the GEMV's unit
floats (1 + c/16 for odd nibbles, 1 + c/256 for even ones, as its plain-Triton twin `unit_float_pair` defines) and
the transposed GEMM's fp16 and bf16 decode (c s + z with one rounding, as its twin `_nibble_dequant` defines). The
interpreter tests check the twins through whole kernels.

The GPU runs the PTX text, CI runs the twins; this ties the two to the same formula where no GPU is."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest

from lmd.turbomind.kernels.w4a16_gemm_wt import DECODE_PTX_BF16, DECODE_PTX_F16
from lmd.turbomind.kernels.w4a16_gemv import _unit_floats_ptx

MASK32 = 0xFFFFFFFF


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX lop3.b32: bit i of the result is lut[(a_i << 2) | (b_i << 1) | c_i]."""
    out = 0
    for bit in range(32):
        index = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> index) & 1) << bit
    return out


def _bf16_round(v: np.ndarray) -> np.ndarray:
    """float64 -> bf16 bits, round to nearest even (the values here are finite)."""
    bits = v.astype(np.float32).view(np.uint32).astype(np.uint64)  # exact: fp32 holds these sums (see _packed)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _halves(bits: int, bf16: bool) -> np.ndarray:
    raw = np.array([bits & 0xFFFF, bits >> 16], dtype=np.uint16)
    if bf16:
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.view(np.float16).astype(np.float64)


def _packed(op: str, *regs: int) -> int:
    """fma.rn / sub(.rn) on f16x2 or bf16x2: exact in float64 (the products and sums of 16-bit floats here fit in
    fp32's 24 bits), then one rounding per half."""
    bf16 = "bf16x2" in op
    a, b, *c = (_halves(r, bf16) for r in regs)
    exact = a * b + c[0] if op.startswith("fma") else a - b
    out = _bf16_round(exact) if bf16 else exact.astype(np.float16).view(np.uint16)
    return int(out[0]) | (int(out[1]) << 16)


def run_ptx(text: str, inputs: dict[str, int], outputs: int = 8) -> list[int]:
    """Registers $0..$(outputs - 1) after the block, given the input registers (only the instructions the blocks
    use)."""
    regs: dict[str, int] = dict(inputs)

    def value(token: str) -> int:
        token = token.strip()
        return int(token, 16) if token.startswith("0x") else int(token) if token.isdigit() else regs[token]

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if pair := re.fullmatch(r"\{(\S+), (\S+)\}, (\S+)", args):  # mov.b32 {lo, hi}, r: split into halves
            regs[pair[1]], regs[pair[2]] = value(pair[3]) & 0xFFFF, value(pair[3]) >> 16
            continue
        if pair := re.fullmatch(r"(\S+), \{(\S+), (\S+)\}", args):  # mov.b32 r, {lo, hi}: join two halves
            regs[pair[1]] = (value(pair[2]) & 0xFFFF) | ((value(pair[3]) & 0xFFFF) << 16)
            continue
        dst, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            regs[dst] = value(src[0])
        elif op == "shl.b32":
            regs[dst] = (value(src[0]) << value(src[1])) & MASK32
        elif op in ("shr.u32", "shr.b32"):
            regs[dst] = value(src[0]) >> value(src[1])
        elif op == "lop3.b32":
            regs[dst] = _lop3(value(src[0]), value(src[1]), value(src[2]), value(src[3]))
        elif op in ("fma.rn.f16x2", "fma.rn.bf16x2", "sub.f16x2", "sub.rn.bf16x2"):
            regs[dst] = _packed(op, *(value(r) for r in src))
        else:
            raise AssertionError(f"unexpected PTX instruction {op}")
    return [regs[f"${i}"] for i in range(outputs)]


def as_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _words(seed: int, count: int = 200) -> list[int]:
    words = np.random.default_rng(seed).integers(0, 2**32, size=count, dtype=np.uint64).tolist()
    return [int(w) for w in words] + [0, MASK32]


def test_gemv_ptx_block_gives_each_nibble_its_unit_float() -> None:
    text = _unit_floats_ptx()
    assert len(re.findall(r"\bshl\.b32|\bshr\.u32", text)) == 4  # one shift per pair of nibbles
    for word in _words(0):
        out = [as_float(bits) for bits in run_ptx(text, {"$8": word})]
        for i in range(8):
            code = (word >> (4 * i)) & 0xF
            want = 1 + code / 16 if i % 2 == 1 else 1 + code / 256
            assert out[i] == want, f"word {word:#010x} nibble {i}: {out[i]} != {want}"


def _bits16(v: float, bf16: bool) -> int:
    return int(_bf16_round(np.array([v]))[0]) if bf16 else int(np.array(v, dtype=np.float16).view(np.uint16))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
def test_wt_ptx_block_dequantizes_each_nibble_with_one_rounding(bf16: bool) -> None:
    text = DECODE_PTX_BF16.value if bf16 else DECODE_PTX_F16.value
    rng = np.random.default_rng(1)
    for word in _words(2):
        s = _halves(_bits16(rng.uniform(1e-4, 0.05), bf16), bf16)[0]
        z = _halves(_bits16(-rng.integers(0, 16) * s, bf16), bf16)[0]  # AWQ: z = -zero_point * s, rounded
        out = run_ptx(text, {"$8": word, "$9": _bits16(s, bf16), "$10": _bits16(z, bf16)})
        for i in range(8):
            code = (word >> (4 * i)) & 0xF
            assert out[i] == _bits16(code * s + z, bf16), f"word {word:#010x} nibble {i}"
