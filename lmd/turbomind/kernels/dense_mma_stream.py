"""The skinny dense GEMM of `dense_mma` as a persistent stream-K kernel: y[M, N] = x[M, K] @ W[N, K]^T with a fixed
grid of a few programs per SM, each walking one contiguous run of the flattened (column tile, key tile) iterations.

Why: at 64 token rows one program of the pipelined kernel fills an SM's shared memory, so a grid of whole tiles
runs in waves that leave SMs idle (the Llama-7B qkv is 192 tiles of 64 columns on 132 SMs: 1.45 waves; wo and w2
are 64 tiles), and every wave boundary drains and refills the copy pipeline. Here every program gets the same
number of key tiles (to one), and its loop runs straight across tile boundaries, so the copies of the next tile are
in flight while the current one finishes.

A tile whose key tiles fall to more than one program is fixed up without a second kernel and without spinning:
each contributor writes its fp32 partial into its own slot (a program has at most two split tiles: the one it
starts in and the one it ends in), then increments the tile's counter; the one that finds every other contributor
done sums the partials in contributor order (the same sum whoever finishes: deterministic), stores the output and
resets the counter to zero for the next call. The counters are indexed by the tile's first contributor, who owns
at most one split tile as its first contributor, so `programs` counters suffice.

Invariant: one workspace (slots and counters) per device, shared by every call: the calls on a device run in one
stream (the engine's step, its CUDA graphs, the planner's timings), and a call's fixups complete before the next
call reads the workspace (stream order; under PDL a kernel touches it only after its griddepcontrol.wait).

Reference: `torch.nn.functional.linear` (CI compares under the interpreter, whose sequential programs exercise
every fixup path; the GPU timing is the dense planner's).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lmd.turbomind.kernels.pdl import pdl_prologue_prefetching, weight_lines

SLOTS_PER_PROGRAM = 2
MAX_PROGRAMS = 4096  # counters kept per device; a launch's grid is capped at this


@triton.jit
def _program_of(i, programs, total):
    """The program whose run holds flat iteration i: program p walks [p * total // programs, (p + 1) * total //
    programs)."""
    return ((i + 1) * programs - 1) // total


@triton.jit
def _slot_of(p, t, programs, total, k_steps):
    """Program p's slot for its split tile t: 0 the tile its run starts in, 1 the one it ends in."""
    return p * 2 + (t != (p * total // programs) // k_steps).to(tl.int32)


@triton.jit
def _store_tile(acc, rn, rm, M, N, b_ptr, y_ptr, stride_ym, HAS_BIAS: tl.constexpr):
    """A finished tile acc [BLOCK_N, BLOCK_M] (y's transpose) into y, with the bias."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    out_mask = (rn < N)[:, None] & (rm < M)[None, :]
    tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _slot_ptrs(slots_ptr, slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pointers [BLOCK_N, BLOCK_M] into fp32 partial slot `slot`."""
    in_slot = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    return slots_ptr + slot.to(tl.int64) * (BLOCK_N * BLOCK_M) + in_slot


@triton.jit
def _join_split_tile(t, pid, programs, total, k_steps, M, N, b_ptr, y_ptr, slots_ptr, counts_ptr, stride_ym,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAX_PARTS: tl.constexpr):
    """This program's partial of split tile t is in its slot: count it in, and if it is the last of the tile's
    contributors to do so, sum their slots in contributor order (the same sum whoever finishes) into y."""
    first = _program_of(t * k_steps, programs, total)
    last = _program_of(t * k_steps + k_steps - 1, programs, total)
    tl.debug_barrier()  # every thread's share of the partial written before the counter says so
    done = tl.atomic_add(counts_ptr + first, 1, sem="acq_rel", scope="gpu")
    if done == last - first:
        tl.debug_barrier()
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for c in tl.static_range(MAX_PARTS):
            p = tl.minimum(first + c, last)  # past the last contributor: a slot that is written, added as 0
            part = tl.load(_slot_ptrs(slots_ptr, _slot_of(p, t, programs, total, k_steps), BLOCK_M, BLOCK_N),
                           cache_modifier=".cg")
            acc += tl.where(first + c > last, 0.0, part)
        _store_tile(acc, t * BLOCK_N + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_M), M, N, b_ptr, y_ptr, stride_ym,
                    HAS_BIAS)
        tl.atomic_xchg(counts_ptr + first, 0, sem="relaxed", scope="gpu")  # zero again for the next call


@triton.jit
def _dense_mma_stream_kernel(x_desc, w_desc, x_ptr, w_ptr, b_ptr, y_ptr, slots_ptr, counts_ptr, M, N, K, total,
                             k_steps, programs, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             MAX_PARTS: tl.constexpr, DESC: tl.constexpr, PREFETCH: tl.constexpr,
                             PF_LINES: tl.constexpr, LINE: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    begin = pid * total // programs
    end = (pid + 1) * total // programs
    t0 = begin // k_steps
    first_rows = t0 * BLOCK_N + tl.arange(0, BLOCK_N)
    lines = weight_lines(w_ptr, first_rows, N, K, (begin - t0 * k_steps) * BLOCK_K, stride_wn, PF_LINES, LINE)
    pdl_prologue_prefetching(USE_PDL, lines, PREFETCH)
    rk = tl.arange(0, BLOCK_K)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # the loop only stores (anything more in it and Triton stops pipelining it); the split tiles, at most the
    # first and the last of the run, are joined after it
    head_split = begin > t0 * k_steps
    for i in range(begin, end):
        t = i // k_steps
        k = (i - t * k_steps) * BLOCK_K
        if DESC:
            w = w_desc.load([t * BLOCK_N, k])
            x = x_desc.load([0, k])
        else:
            rn = t * BLOCK_N + tl.arange(0, BLOCK_N)
            k_ok = (k + rk) < K
            w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (k + rk)[None, :],
                        mask=(rn < N)[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (k + rk)[None, :], mask=(rm < M)[:, None] & k_ok[None, :],
                        other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        if i - t * k_steps == k_steps - 1:  # the tile ends in this run
            if (t == t0) & head_split:
                tl.store(_slot_ptrs(slots_ptr, pid * 2, BLOCK_M, BLOCK_N), acc)
            else:
                _store_tile(acc, t * BLOCK_N + tl.arange(0, BLOCK_N), rm, M, N, b_ptr, y_ptr, stride_ym, HAS_BIAS)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t_end = (end - 1) // k_steps
    tail_split = end < (t_end + 1) * k_steps
    if tail_split:  # the run ends inside tile t_end: its partial is still in acc
        tl.store(_slot_ptrs(slots_ptr, _slot_of(pid, t_end, programs, total, k_steps), BLOCK_M, BLOCK_N), acc)
    if head_split & ((t0 < t_end) | ~tail_split):  # the head tile ended in the run: stored in the loop
        _join_split_tile(t0, pid, programs, total, k_steps, M, N, b_ptr, y_ptr, slots_ptr, counts_ptr, stride_ym,
                         HAS_BIAS, BLOCK_M, BLOCK_N, MAX_PARTS)
    if tail_split:
        _join_split_tile(t_end, pid, programs, total, k_steps, M, N, b_ptr, y_ptr, slots_ptr, counts_ptr, stride_ym,
                         HAS_BIAS, BLOCK_M, BLOCK_N, MAX_PARTS)


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device)


@functools.cache
def _slots(device: torch.device, programs: int, slot_elems: int) -> torch.Tensor:
    # kept for the process: a captured CUDA graph holds its address
    return torch.empty(programs * SLOTS_PER_PROGRAM * slot_elems, dtype=torch.float32, device=device)


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def stream_grid(n: int, k: int, block_n: int, block_k: int, per_sm: int, device: torch.device) -> tuple[int, int]:
    """(programs, most contributors a tile can have) for a launch: per_sm programs an SM, no more than iterations."""
    k_steps = triton.cdiv(k, block_k)
    total = triton.cdiv(n, block_n) * k_steps
    programs = min(per_sm * sm_count(device), total, MAX_PROGRAMS)
    shortest = total // programs  # every run holds at least this many iterations (programs <= total)
    return programs, 1 + triton.cdiv(k_steps - 1, shortest)


def launch_stream(x: torch.Tensor, weight: torch.Tensor, b: torch.Tensor, y: torch.Tensor, has_bias: bool,
                  block_m: int, block_n: int, block_k: int, per_sm: int, x_desc, w_desc,
                  flags: dict[str, object]) -> None:
    """Run the stream-K kernel into y ([M, N], x's dtype). x_desc and w_desc: tensor descriptors of x and the
    weight, or None for pointer loads. flags: num_warps, num_stages, the prefetch and PDL flags."""
    m, k = x.shape
    n = weight.shape[0]
    programs, parts = stream_grid(n, k, block_n, block_k, per_sm, x.device)
    k_steps = triton.cdiv(k, block_k)
    slots = _slots(x.device, programs, block_n * block_m)
    desc = x_desc is not None
    _dense_mma_stream_kernel[(programs,)](x_desc if desc else x, w_desc if desc else weight, x, weight, b, y, slots,
                                          _counters(x.device), m, n, k, triton.cdiv(n, block_n) * k_steps, k_steps,
                                          programs, x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=has_bias,
                                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, MAX_PARTS=parts,
                                          DESC=desc, **flags)
