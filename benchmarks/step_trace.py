"""Where a serving run's time goes, step by step: wraps a running engine's `runner.run` (the engine thread looks it up
every step) and records, per step, the chunks it ran (decode rows, prefill tokens), whether it replayed a CUDA graph,
its GPU time (CUDA events around the forward, sampling excluded; idle gaps inside count) and the host time its launch
took (the call returns once the work is queued: a launch as long as the GPU time says the step is host-bound).
On CUDA it also brackets the sampler's launch with events, so the GPU time between one forward's end and the next
one's start splits into: before the sampling (the row gather, or the GPU idle while the host had not yet queued the
sampling), the sampling, and after it (the GPU idle until the host queued the next step: exposed host time). A
summary splits the run's wall time into decode-only and mixed (prefill) steps and says how long the batch stayed full.
It also counts the Triton kernels compiled during the run (Triton's JIT hooks; a fresh machine has no disk cache, so
each new specialization of a kernel stalls the host inside some step) and their host time.

    with StepTrace(engine) as trace:
        ...  # the timed run
    trace.summary()
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


class StepTrace:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps: list[dict[str, Any]] = []
        self._events: list[tuple[Any, Any]] = []
        self._cuda = engine.runner.device.type == "cuda"

    def __enter__(self) -> StepTrace:
        runner = self.engine.runner
        original = type(runner).run.__get__(runner)

        def traced(output: Any, *args: Any, **kwargs: Any) -> Any:
            lengths = [len(c.token_ids) for c in output.chunks]
            # decode-only steps replay graphs when the runner has them (speculative steps are not traced apart)
            graph = runner.graphs is not None and all(n == 1 for n in lengths) and kwargs.get("adjust") is None
            start = end = None
            if self._cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            result = original(output, *args, **kwargs)
            host_ms = (time.perf_counter() - t) * 1e3  # launches queued; nothing here waits for the GPU
            if self._cuda:
                end.record()
            self._events.append((start, end))
            self.steps.append(dict(t=t, host_ms=host_ms, decode=sum(n == 1 for n in lengths),
                                   prefill_tokens=sum(n for n in lengths if n > 1), graph=graph))
            return result

        runner.run = traced
        sampler = self.engine.sampler
        self._samples: dict[int, tuple[Any, Any]] = {}
        launch = type(sampler).launch.__get__(sampler)

        def traced_launch(*args: Any, **kwargs: Any) -> Any:
            if not self._cuda:
                return launch(*args, **kwargs)
            s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s0.record()
            result = launch(*args, **kwargs)
            s1.record()
            self._samples.setdefault(len(self.steps) - 1, (s0, s1))  # the step whose logits it samples
            return result

        sampler.launch = traced_launch
        self.compiles: list[dict[str, Any]] = []
        self._hooks = _compile_hooks(self.compiles)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._t1 = time.perf_counter()
        del self.engine.runner.run  # the class's method again
        del self.engine.sampler.launch
        if self._hooks is not None:
            knobs, before = self._hooks
            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before
        if self._cuda:
            torch.cuda.synchronize()
        for i, (step, (start, end)) in enumerate(zip(self.steps, self._events, strict=True)):
            step["gpu_ms"] = start.elapsed_time(end) if start is not None else None
            following = self._events[i + 1][0] if i + 1 < len(self._events) else None
            sample = self._samples.get(i)
            if following is not None and sample is not None:
                step["before_sample_ms"] = end.elapsed_time(sample[0])
                step["sample_ms"] = sample[0].elapsed_time(sample[1])
                step["after_sample_ms"] = sample[1].elapsed_time(following)

    def summary(self) -> dict[str, Any]:
        steps = self.steps
        wall = self._t1 - self._t0
        out: dict[str, Any] = {"wall_s": wall, "steps": len(steps)}
        if not steps:
            return out
        max_batch = self.engine.workspace.engine.max_batch_size
        intervals = [b["t"] - a["t"] for a, b in zip(steps, steps[1:], strict=False)] + [self._t1 - steps[-1]["t"]]
        for kind, pick in (("decode", lambda s: s["prefill_tokens"] == 0), ("mixed", lambda s: s["prefill_tokens"] > 0)):
            chosen = [(s, dt) for s, dt in zip(steps, intervals, strict=True) if pick(s)]
            gpu = [s["gpu_ms"] for s, _ in chosen if s["gpu_ms"] is not None]
            out[kind] = dict(
                steps=len(chosen), wall_s=sum(dt for _, dt in chosen), gpu_s=sum(gpu) / 1e3,
                graph_steps=sum(s["graph"] for s, _ in chosen),
                mean_rows=statistics.fmean(s["decode"] for s, _ in chosen) if chosen else 0.0,
                prefill_tokens=sum(s["prefill_tokens"] for s, _ in chosen),
                median_gpu_ms=statistics.median(gpu) if gpu else None,
                host_launch_s=sum(s["host_ms"] for s, _ in chosen) / 1e3,
                median_host_launch_ms=statistics.median(s["host_ms"] for s, _ in chosen) if chosen else None)
            gaps = [s for s, _ in chosen if "after_sample_ms" in s]
            if gaps:  # where the GPU time between forwards went (CUDA only), medians and sums per step
                for part in ("before_sample_ms", "sample_ms", "after_sample_ms"):
                    out[kind][f"median_{part}"] = statistics.median(s[part] for s in gaps)
                    out[kind][f"{part.removesuffix('_ms')}_s"] = sum(s[part] for s in gaps) / 1e3
        gpu_total = sum(s["gpu_ms"] or 0.0 for s in steps) / 1e3
        out["gpu_forward_s"] = gpu_total
        rows = [s["decode"] + (s["prefill_tokens"] > 0) for s in steps]
        out["mean_rows"] = statistics.fmean(rows)
        if max_batch:
            full = [i for i, s in enumerate(steps) if s["decode"] >= max_batch - 8]
            out["last_full_batch_s"] = (steps[full[-1]]["t"] - self._t0) if full else 0.0
        tail = [dt for s, dt in zip(steps, intervals, strict=True) if s["decode"] < 64 and s["prefill_tokens"] == 0]
        out["tail_below_64_rows"] = dict(steps=len(tail), wall_s=sum(tail))
        done = [c for c in self.compiles if "s" in c]
        out["triton_compiles"] = dict(count=len(self.compiles), host_s=sum(c["s"] for c in done),
                                      kernels=sorted({c["kernel"] for c in self.compiles}))
        return out


def _compile_hooks(compiles: list[dict[str, Any]]) -> tuple[Any, tuple[Any, Any]] | None:
    """Install Triton JIT hooks that append {kernel, s} per compile to `compiles`; returns (knobs, previous hooks)
    to restore, or None where this Triton has no such hooks."""
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return None
    before = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)

    def start(*, fn: Any, **_: Any) -> None:  # returning a true value would skip the compile
        compiles.append(dict(kernel=getattr(fn, "name", str(fn)), t=time.perf_counter()))

    def end(*, fn: Any, **_: Any) -> None:
        name = getattr(fn, "name", str(fn))
        for c in reversed(compiles):
            if c["kernel"] == name and "s" not in c:
                c["s"] = time.perf_counter() - c.pop("t")
                break

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = start, end
    return knobs, before
