"""Programmatic dependent launch (PDL, sm_90 and later) for the decode step's Triton kernels.

A decode step is ~10 small kernels per layer (norm, GEMV, rotary + KV write, attention, its combine, ...), replayed
as a CUDA graph; at batch 1 each boundary costs the next kernel's launch and ramp-up while the previous one drains.
Launched with PDL (`launch_pdl`), a kernel may be scheduled onto free SMs while the one before it in the stream is
still finishing. Every such kernel starts with `griddepcontrol.wait` (the previous kernel complete, its writes
visible) before it reads anything, then `griddepcontrol.launch_dependents` (the next kernel may be scheduled).

Why the chain stays ordered: a kernel that reads what the kernel two launches back wrote is safe, because the one in
between cannot complete before its own wait has returned. A kernel launched without PDL (cuBLAS, torch) waits for
everything before it as usual, and one that precedes a PDL kernel without triggering it lets it start at its end.

`LMD_PDL=0` turns it off (read once per process). Off on CPU, under TRITON_INTERPRET=1 and before sm_90: the kernels
then compile without the two instructions and launch as before.

A kernel launched early may also start reading what no earlier kernel writes — its weights — before it waits
(`pdl_prologue_prefetching`): L2 prefetches of the first tiles it will load, issued while the previous kernel is
still running, so its first loads find the lines in L2 instead of waiting on DRAM. Addresses must be valid (the
callers clamp them into the tensor); a prefetch is a hint and changes no value.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl


@functools.cache
def _enabled(device_type: str, index: int | None) -> bool:
    if device_type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("LMD_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    return _enabled(device.type, device.index)


def pdl_options(device: torch.device) -> dict[str, Any]:
    """The kernel launch's keyword arguments: USE_PDL for the kernel's prologue, launch_pdl for the launch."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"USE_PDL": False}


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """First thing in a kernel launched with `pdl_options`: wait for the previous kernel, then let the next one be
    scheduled."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def prefetch_flags(prefetch: int, block_k: int, weight: torch.Tensor) -> dict[str, int]:
    """The launch's PREFETCH (key tiles), PF_LINES (cache lines a weight row, at least 1) and LINE (elements of a
    128-byte line) for `weight_lines`."""
    line = 128 // weight.element_size()
    return {"PREFETCH": prefetch, "PF_LINES": max(1, prefetch * block_k // line), "LINE": line}


@triton.jit
def weight_lines(w_ptr, rows, N, K, k_start, stride_wn, PF_LINES: tl.constexpr, LINE: tl.constexpr):
    """Pointers to the cache lines of weight rows `rows` from column k_start on, PF_LINES lines a row, clamped into
    the weight [N, K] (the prefetch hint of `pdl_prologue_prefetching` needs valid addresses)."""
    cols = tl.minimum(k_start + tl.arange(0, PF_LINES) * LINE, K - 1)
    return w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn + cols[None, :]


@triton.jit
def prefetch_l2(ptrs):
    """Hint: bring the cache lines holding `ptrs` (valid addresses, any shape) into L2."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def pdl_prologue_prefetching(USE_PDL: tl.constexpr, ptrs, PREFETCH: tl.constexpr):
    """`pdl_prologue`, first prefetching `ptrs` into L2 when PREFETCH (and PDL) is on: without PDL the previous
    kernel has finished before this one starts, and there is nothing to overlap."""
    if USE_PDL:
        if PREFETCH:
            prefetch_l2(ptrs)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
