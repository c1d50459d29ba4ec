"""The GEMV's PTX decode block, executed here instruction by instruction on random words: each output must be the
unit float of its nibble, 1 + c/16 (odd) or 1 + c/256 (even), the values the plain-Triton twin `unit_float_pair`
defines and the interpreter tests check through the whole kernel.

The GPU runs the PTX text, CI runs the twin; this ties the two to the same formula where no GPU is."""

from __future__ import annotations

import re
import struct

import numpy as np

from lmd.turbomind.kernels.w4a16_gemv import _unit_floats_ptx

MASK32 = 0xFFFFFFFF


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX lop3.b32: bit i of the result is lut[(a_i << 2) | (b_i << 1) | c_i]."""
    out = 0
    for bit in range(32):
        index = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> index) & 1) << bit
    return out


def run_ptx(text: str, word: int) -> list[int]:
    """Registers $0..$7 after the block, with $8 = word (only the instructions the block uses)."""
    regs: dict[str, int] = {"$8": word}

    def value(token: str) -> int:
        token = token.strip()
        return int(token, 16) if token.startswith("0x") else int(token) if token.isdigit() else regs[token]

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            regs[dst] = value(src[0])
        elif op == "shl.b32":
            regs[dst] = (value(src[0]) << value(src[1])) & MASK32
        elif op == "shr.u32":
            regs[dst] = value(src[0]) >> value(src[1])
        elif op == "lop3.b32":
            regs[dst] = _lop3(value(src[0]), value(src[1]), value(src[2]), value(src[3]))
        else:
            raise AssertionError(f"unexpected PTX instruction {op}")
    return [regs[f"${i}"] for i in range(8)]


def as_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def test_ptx_block_gives_each_nibble_its_unit_float() -> None:
    text = _unit_floats_ptx()
    assert len(re.findall(r"\bshl\.b32|\bshr\.u32", text)) == 4  # one shift per pair of nibbles
    words = np.random.default_rng(0).integers(0, 2**32, size=200, dtype=np.uint64).tolist() + [0, MASK32]
    for word in words:
        out = [as_float(bits) for bits in run_ptx(text, int(word))]
        for i in range(8):
            code = (int(word) >> (4 * i)) & 0xF
            want = 1 + code / 16 if i % 2 == 1 else 1 + code / 256
            assert out[i] == want, f"word {word:#010x} nibble {i}: {out[i]} != {want}"
