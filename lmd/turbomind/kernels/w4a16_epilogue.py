"""Shared pieces of the W4A16 kernels: split-K ranges, optional masks, bias, cast and the single-launch split-K
reduction.

Split-K without a second launch or a memset: every program of a split-K tile adds its fp32 partial into a workspace
with atomics, then bumps the tile's counter. The program that sees the counter reach SPLIT_K - 1 is the last one: it
reads the sum, stores the workspace back to zero, resets the counter and writes the output. So the workspace and
the counters are all-zero between launches, which is what lets a CUDA graph replay the kernel with no set-up nodes.

Invariants: the workspace holds at least M * N fp32 and the counters at least one int32 per output tile for every
split-K launch (`SplitKWorkspace.get` grows them; grow them before a CUDA graph is captured, see `w4a16.prewarm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TILES = 1 << 16  # counters per device; one per (M tile, N tile) of a split-K launch


@triton.jit
def load_tile(ptrs, mask, other, UNMASKED: tl.constexpr):
    """tl.load with the mask, or without one when the caller knows the tile is in bounds (no predicates)."""
    if UNMASKED:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def split_k_steps(pid_k, steps, SPLIT_K: tl.constexpr):
    """The K steps [first, last) of split pid_k when SPLIT_K programs share `steps` (the last may get fewer)."""
    per_split = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per_split
    return first, tl.minimum(first + per_split, steps)


@triton.jit
def cast_bias_store(acc, offs_m, offs_n, M, N, out_ptr, bias_ptr, HAS_BIAS: tl.constexpr):
    """acc fp32 [BM, BN] (+ bias[n]) -> out[m, n] in out's dtype."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_tile(acc, offs_m, offs_n, M, N, out_ptr, bias_ptr, ws_ptr, cnt_ptr, tile_id,
               HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Write one output tile; with SPLIT_K > 1 reduce the partials through the self-cleaning workspace."""
    if SPLIT_K == 1:
        cast_bias_store(acc, offs_m, offs_n, M, N, out_ptr, bias_ptr, HAS_BIAS)
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        ws = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        # relaxed adds, a CTA barrier, then one release on the counter: the semaphore pattern of CUTLASS's split-K
        # (a release on every element would put a fence before each of them)
        tl.atomic_add(ws, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()
        seen = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
        if seen == SPLIT_K - 1:
            total = tl.atomic_add(ws, tl.zeros_like(acc), mask=mask, sem="relaxed")  # an L2-coherent read
            tl.store(ws, tl.zeros_like(acc), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile_id, 0)
            cast_bias_store(total, offs_m, offs_n, M, N, out_ptr, bias_ptr, HAS_BIAS)


class SplitKWorkspace:
    """Per-device fp32 workspace and tile counters for the split-K kernels (grown, never shrunk). Two kinds, in
    buffers of their own: "zeroed", the self-cleaning workspace the kernels that add their partials atomically need
    all-zero between launches; "partials", slots the wgmma GEMM overwrites and never cleans (its counters are reset
    all the same), which must never leave garbage in the zeroed one."""

    _buffers: dict[tuple[str, int | None, str], tuple[torch.Tensor, torch.Tensor]] = {}
    _retired: list[torch.Tensor] = []  # outgrown buffers stay alive: a captured CUDA graph may still point at them

    @classmethod
    def get(cls, device: torch.device, numel: int, tiles: int, kind: str = "zeroed") -> tuple[torch.Tensor, torch.Tensor]:
        if tiles > MAX_TILES:
            raise ValueError(f"split-K launch with {tiles} tiles exceeds the {MAX_TILES} counters")
        key = (device.type, device.index, kind)
        ws, cnt = cls._buffers.get(key, (None, None))
        if ws is None or ws.numel() < numel:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("W4A16 split-K workspace must be grown before CUDA graph capture: call prewarm()")
            if ws is not None:
                cls._retired.append(ws)
            ws = torch.zeros(max(numel, 1 << 20), dtype=torch.float32, device=device)
            cnt = torch.zeros(MAX_TILES, dtype=torch.int32, device=device) if cnt is None else cnt
            cls._buffers[key] = (ws, cnt)
        return ws, cnt


def tile_launch_buffers(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block_m: int, block_n: int,
                        split_k: int) -> tuple[int, int, int, int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a tiled W4A16 launch needs: (M, N, K, group, tiles, out, workspace, counters); without split-K the
    workspace and counters are unused (out stands in for them)."""
    m, k = x2d.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    ws, cnt = SplitKWorkspace.get(x2d.device, m * n, tiles) if split_k > 1 else (out, out)
    return m, n, k, k // scales.shape[0], tiles, out, ws, cnt
