"""Does prefetching a layer's next weights into L2 while its attention runs shorten the int4 decode step? A CUDA
machine (sm_90: `cp.async.bulk.prefetch.L2`).

    python3 benchmarks/l2_prefetch_probe.py [--batches 1,16] [--context 128] [--variants base,fork,wo,...]

At small batches a decode step's attention, norms and rotary run a few microseconds each on little DRAM traffic,
while the W4A16 GEMVs around them stream weights at ~1.5-2 TB/s of the ~3 an H100 copy reaches (docs/benchmarks.md,
twenty-fourth session). Here each layer, as its attention starts, forks a side stream (captured into the decode
graph as a parallel branch) that asks L2 for the weights of the linears that follow it: `wo`, then a fraction of
`w13` (the first bytes of each tensor: the K rows the GEMVs' first CTAs read), one bulk prefetch per thread, a chunk
of CHUNK bytes each. The side stream joins the main one after the last layer. Variants:

    base          no fork (the engine as it is)
    fork          the fork and join with a zero-byte prefetch (what the extra graph edges cost)
    wo            wo's words, scales and zeros
    wo+w13:F      and the first fraction F of w13's words (scales and zeros whole)

For each batch the engine (int4 Llama-2-7B shape, random weights, decode graphs) decodes at `--context`; each variant
re-captures the graphs with its patch and times graph replay (CUDA events, the median of 7 runs of 50 replays).
The decode's greedy tokens of one step are compared with base's (a prefetch must not change them). Prints a table
last; $OUT/l2_prefetch_probe.json holds every run. Measurement only: lmd itself does not prefetch.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode_step_kernels import SHAPES, decoding_engine, replay_ms, running_batch_graph  # noqa: E402
from engine import build_workspace  # noqa: E402

from lmd.turbomind import attention as attention_module  # noqa: E402
from lmd.turbomind.kernels import nvrtc  # noqa: E402
from lmd.turbomind.model import LlamaModel  # noqa: E402

CHUNK = 64 * 1024
SOURCE = r"""
extern "C" __global__ void l2_prefetch(const char* base, int bytes, int chunk) {
    // one bulk prefetch (the TMA unit's, no registers held) per thread and chunk; sizes are multiples of 16
    for (long long i = (long long)(blockIdx.x * blockDim.x + threadIdx.x) * chunk; i < bytes;
         i += (long long)gridDim.x * blockDim.x * chunk) {
        const unsigned n = bytes - i < chunk ? (unsigned)(bytes - i) : (unsigned)chunk;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(base + i), "r"(n) : "memory");
    }
}
"""


class Prefetcher:
    """The patch: `fire(layer)` as a layer's attention starts, `join()` after the last layer."""

    def __init__(self, model: LlamaModel, variant: str) -> None:
        self.variant, self.side = variant, torch.cuda.Stream()
        self.dummy = torch.zeros(16, dtype=torch.uint8, device="cuda")  # the fork variant's zero-byte target
        self.kernel = nvrtc.compile_kernel(SOURCE, "l2_prefetch", torch.cuda.current_device())
        self.forked = False
        self.targets: list[list[tuple[torch.Tensor, int]]] = []
        fraction = float(variant.split(":")[1]) if ":" in variant else 0.0
        for layer in model.layers:
            wo, w13 = layer.attention.wo, layer.mlp.w13
            spans: list[tuple[torch.Tensor, int]] = []
            if variant != "fork":
                spans += [(t, t.numel() * t.element_size()) for t in (wo.qweight, wo.scales, wo.zeros)]
            if fraction:
                words = w13.qweight.numel() * w13.qweight.element_size()
                spans.append((w13.qweight, int(words * fraction) // 16 * 16))
                spans += [(t, t.numel() * t.element_size()) for t in (w13.scales, w13.zeros)]
            self.targets.append(spans)

    def fire(self, layer: int) -> None:
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)  # after this layer's qkv GEMV
        with torch.cuda.stream(self.side):
            for tensor, nbytes in self.targets[layer] or [(self.dummy, 0)]:
                threads = max(1, min(256, -(-nbytes // CHUNK)))
                blocks = max(1, -(-nbytes // (CHUNK * threads)))
                nvrtc.launch(self.kernel, (blocks, 1, 1), (threads, 1, 1), [tensor, nbytes, CHUNK])
        self.forked = True

    def join(self) -> None:
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.side)
            self.forked = False


ACTIVE: list[Prefetcher | None] = [None]


def install_patches() -> None:
    """Wrap the attention's first call after the qkv GEMV (rope_decode_attention, reached on every CUDA decode) and
    the model's layer loop, so that the active Prefetcher (if any) fires and joins."""
    plain_rope, plain_layers = attention_module.rope_decode_attention, LlamaModel.run_layers

    def rope_decode_attention(qkv, cos, sin, cache, layer, *args, **kwargs):
        if ACTIVE[0] is not None:
            ACTIVE[0].fire(layer)
        return plain_rope(qkv, cos, sin, cache, layer, *args, **kwargs)

    def run_layers(self, *args, **kwargs):
        out = plain_layers(self, *args, **kwargs)
        if ACTIVE[0] is not None:
            ACTIVE[0].join()
        return out

    attention_module.rope_decode_attention = rope_decode_attention
    LlamaModel.run_layers = run_layers


def step_ms(engine, runs: int = 7, replays: int = 50) -> tuple[float, list[float], torch.Tensor]:
    """The median of `runs` timings of `replays` graph replays of the running batch, every run, and the step's
    greedy tokens."""
    graph, logits = running_batch_graph(engine)
    times = [replay_ms(graph, replays) for _ in range(runs)]
    return sorted(times)[runs // 2], times, logits.argmax(-1).cpu()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--variants", default="base,fork,wo,wo+w13:0.25,wo+w13:0.5,base")
    args = p.parse_args()
    install_patches()
    variants = args.variants.split(",")
    results: dict = {"gpu": torch.cuda.get_device_name(), "context": args.context, "batches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ws = build_workspace(Path(tmp, "ws"), SHAPES["llama2-7b"], True, 2048, torch.device("cuda"))
        for batch in (int(b) for b in args.batches.split(",")):
            ns = argparse.Namespace(batch=batch, steps=0, prefill=0, quant_policy=0)
            engine = decoding_engine(ws, ns, args.context, cuda_graph=True, device="cuda")
            rows, base_tokens = {}, None
            for i, variant in enumerate(variants):
                ACTIVE[0] = None if variant == "base" else Prefetcher(engine.runner.model, variant)
                engine.runner.graphs.release()
                engine.runner.enable_decode_graphs(capture=True)
                ms, times, tokens = step_ms(engine)
                ACTIVE[0] = None
                base_tokens = tokens if base_tokens is None else base_tokens
                same = bool(torch.equal(tokens, base_tokens))
                rows[f"{i} {variant}"] = {"ms": ms, "runs_ms": times, "same_tokens_as_base": same}
                print(f"batch {batch}, {variant:14s}: {ms:.4f} ms a step (runs {min(times):.4f}-{max(times):.4f}), "
                      f"tokens {'same' if same else 'DIFFER'}", flush=True)
            results["batches"][batch] = rows
            engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    Path(os.environ.get("OUT", "."), "l2_prefetch_probe.json").write_text(json.dumps(results, indent=1))
    print(f"\n{results['gpu']}, int4 Llama-2-7B shape, context {args.context}: graph replay ms a step")
    for batch, rows in results["batches"].items():
        base = next(r["ms"] for name, r in rows.items() if name.endswith(" base"))
        cells = ", ".join(f"{name.split(' ', 1)[1]} {r['ms']:.4f} ({base / r['ms']:.3f}x)" for name, r in rows.items())
        print(f"  batch {batch}: {cells}")


if __name__ == "__main__":
    main()
