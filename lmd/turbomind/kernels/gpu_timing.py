"""Timing one kernel call as it runs inside a forward pass: cold weights, no launch overhead (`cold_call_ms`: one
call at a time; `graph_call_ms`: calls in a CUDA graph, each behind the kernel that precedes it in a layer, so a
kernel launched with programmatic dependent launch gets the early start it gets in a decode step)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

W = TypeVar("W")  # one weight, or a set of tensors, as fn takes it


def cold_call_ms(fn: Callable[[], object], flush: torch.Tensor, reps: int = 15) -> float:
    """Median GPU time of single calls, each after overwriting `flush` (a buffer larger than L2: cold weights, as in
    a forward pass). A spin kernel keeps the GPU busy while the host launches, so launch overhead stays out, as it
    does in CUDA-graph replays."""
    fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda._sleep(200_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in times)[reps // 2]


def graph_ms(fns: Sequence[Callable[[], object]], reps: int = 7) -> float:
    """Median GPU time per fn of running every fn in order, captured as one CUDA graph (warmed up outside it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # compile, tune and allocate outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # entering frees the private pools of the graphs deleted before (empty_cache)
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(fns))
    del graph
    return statistics.median(times)


def graph_call_ms(fn: Callable[[W], object], weights: Sequence[W], prelude: Callable[[], object],
                  calls: int = 24) -> float:
    """GPU time per `prelude(); fn(w)` in a CUDA graph of at least `calls` of them, w rotating over `weights` (copies
    worth more than L2, `cold_copies`: each call finds its weight cold; every copy is called, or the ones called
    could fit in L2). The prelude's time is included: compare candidates with it."""
    calls = max(calls, len(weights))
    return graph_ms([lambda w=weights[i % len(weights)]: (prelude(), fn(w)) for i in range(calls)])


def copies_for(set_bytes: int, l2_bytes: int) -> int:
    """Weight sets (the original and its copies) whose bytes exceed twice the L2."""
    return 2 * l2_bytes // max(set_bytes, 1) + 1


def cold_copies(tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """`tensors` (one weight, or a set such as int4 codes, scales and zeros) and `copies_for` minus one copies of
    them, fewer where GPU memory is short: a graph rotating over them finds each call's weights cold."""
    device = tensors[0].device
    set_bytes = sum(t.numel() * t.element_size() for t in tensors)
    sets = [tensors]
    for _ in range(copies_for(set_bytes, torch.cuda.get_device_properties(device).L2_cache_size) - 1):
        try:
            sets.append(tuple(t.clone() for t in tensors))
        except torch.OutOfMemoryError:
            break
    return sets
