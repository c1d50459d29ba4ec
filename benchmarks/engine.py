"""Engine throughput and latency on a random-weight Llama-2-7B-shaped workspace, fp16 and int4 (a CUDA machine).

    python3 benchmarks/engine.py [--weights fp16,int4] [--cuda-graph on,off] [--num-prompts 256] [--concurrency 64]
    python3 benchmarks/engine.py --tiny        # a tiny model on CPU: runs every step of the script in seconds

No checkpoint and no network: each workspace is written by lmd's own deploy writer (`write_weights`) from a reader
that makes random tensors on the fly (fp16 N(0, 0.02) weights; int4 = random AWQ codes with zero 8 and one scale, so
the int4 deploy path `awq_to_engine` runs as for a real checkpoint), plus a synthetic word-level tokenizer
("t3", "t4", ...). Prompts are random token ids and every request generates exactly its output length (EOS
ignored), so random weights measure the same work as real ones. int4 kernels are tuned for every M bucket up to
max_context_token_num before timing (`w4a16.prewarm`). Measurement is lmd.bench's (`lmd bench throughput --dataset
random` and `lmd bench latency`). Writes $OUT/engine.json (or ./engine.json) and prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmd.arch import ARCHITECTURES  # noqa: E402
from lmd.bench.latency import LatencyConfig, run_latency  # noqa: E402
from lmd.bench.report import latency_report, throughput_report  # noqa: E402
from lmd.bench.sampling import random_requests  # noqa: E402
from lmd.bench.throughput import run_throughput  # noqa: E402
from lmd.deploy.config_from_hf import ModelDims, build_workspace_config  # noqa: E402
from lmd.deploy.int4_schemes import Int4Scheme  # noqa: E402
from lmd.deploy.source_weights import TensorReader  # noqa: E402
from lmd.deploy.weight_writer import write_weights  # noqa: E402
from lmd.turbomind.kernels.w4a16_layout import pack_awq_int32  # noqa: E402
from lmd.workspace_format.config_ini import tokenizer_dir, write_workspace_config  # noqa: E402

# transformers LlamaConfig keywords of a model shape
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
LLAMA2_7B = dict(zip(SHAPE_KEYS, (4096, 11008, 32, 32, 32), strict=True), vocab_size=32000)
TINY = dict(zip(SHAPE_KEYS, (256, 512, 2, 4, 2), strict=True), vocab_size=1000)  # the CPU check (--tiny)
GROUP = 128
INT4_SCALE = 0.02 / 4.6  # codes 0..15 around zero 8 have std ~4.6: weights of std ~0.02 like the fp16 ones


class RandomReader(TensorReader):
    """HF-named Llama tensors made on request: norms are ones, int4 linears AWQ-packed random codes, W8A8 linears
    (`w8a8` int8 / fp8) random per-channel codes with one scale, so that code x scale has the float weights' 0.02
    spread."""

    W8A8_CODE_STD = {"int8": 127 / 3**0.5, "fp8": 64.0}  # uniform int8 codes; e4m3 codes ~ N(0, 64), clamped

    def __init__(self, int4: bool, device: torch.device, seed: int = 0, w8a8: str | None = None) -> None:
        super().__init__("random weights")
        self.int4, self.device, self.w8a8 = int4, device, w8a8
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.linears = tuple(f".{name}" for name in ARCHITECTURES["llama"].linears)
        self._rows: dict[str, int] = {}  # linear -> output rows, for its weight_scale (asked for without a shape)

    def _is_linear(self, name: str) -> bool:
        return name.rsplit(".", 1)[0].endswith(self.linears)

    def has(self, name: str) -> bool:
        suffix = name.rsplit(".", 1)[1]
        if suffix == "bias":
            return False
        if self._is_linear(name):
            if self.int4:
                return suffix in ("qweight", "qzeros", "scales")
            return suffix in (("weight", "weight_scale") if self.w8a8 else ("weight",))
        return suffix == "weight"

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        module, suffix = name.rsplit(".", 1)
        if suffix == "weight_scale" and module in self._rows:
            std = self.W8A8_CODE_STD[self.w8a8]  # type: ignore[index]
            return torch.full((self._rows[module], 1), 0.02 / std, dtype=torch.float32, device=self.device)
        assert shape is not None and self.has(name), name
        kw = dict(device=self.device, generator=self.generator)
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.float16, device=self.device)
        if name.endswith(".qweight"):  # 8 random 4-bit codes per int32
            return torch.randint(-(2**31), 2**31, shape, dtype=torch.int64, **kw).to(torch.int32)
        if name.endswith(".qzeros"):
            return pack_awq_int32(torch.full((shape[0], shape[1] * 8), 8, dtype=torch.int32, device=self.device))
        if name.endswith(".scales"):
            return torch.full(shape, INT4_SCALE, dtype=torch.float16, device=self.device)
        if self.w8a8 and self._is_linear(name):
            self._rows[module] = shape[0]
            if self.w8a8 == "int8":
                return torch.randint(-127, 128, shape, dtype=torch.int8, **kw)
            codes = torch.randn(shape, dtype=torch.float32, **kw) * self.W8A8_CODE_STD["fp8"]
            return codes.clamp(-448, 448).to(torch.float8_e4m3fn)
        return (torch.randn(shape, dtype=torch.float32, **kw) * 0.02).to(torch.float16)


def write_tokenizer(path: Path, vocab_size: int):
    """A word-level tokenizer over "<unk>", "<s>", "</s>", "t3" ... "t{vocab_size-1}": enough to detokenize."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(str(path))
    return tokenizer


def build_workspace(root: Path, shape: dict, int4: bool, session_len: int, device: torch.device,
                    w8a8: str | None = None, tp: int = 1) -> Path:
    """The workspace `lmd deploy` would write for a Llama checkpoint of this shape (fp16, AWQ int4 g128, or a W8A8
    compressed-tensors one: `w8a8` int8 / fp8), its weights cut into `tp` rank files."""
    from transformers import LlamaConfig

    config = LlamaConfig(**shape, max_position_embeddings=session_len, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    dims = ModelDims.from_config(config, "random weights")
    tokenizer = write_tokenizer(tokenizer_dir(root), config.vocab_size)
    cfg = build_workspace_config(
        model_name="base",
        config=config,
        dims=dims,
        tokenizer=tokenizer,
        model_dir=None,
        tp=tp,
        weight_type="int4" if int4 else (w8a8 or "fp16"),
        group_size=GROUP if int4 else 0,
        compute_dtype="fp16",
        where="random weights",
    )
    scheme = Int4Scheme("awq", GROUP, sym=False, act_order=False) if int4 else None  # RandomReader packs AWQ's way
    write_weights(root, RandomReader(int4, device, w8a8=w8a8), ARCHITECTURES["llama"], cfg, dims, torch.float16,
                  progress=False, scheme=scheme)
    write_workspace_config(root, cfg)
    return root


def prewarm_int4(ws: Path, max_m: int, device: torch.device) -> None:
    """Tune every int4 shape of the workspace for every M bucket up to max_m, so timing never includes tuning."""
    from safetensors import safe_open

    from lmd.turbomind.kernels.w4a16 import prewarm

    shapes = set()
    with safe_open(str(ws / "triton_models" / "weights" / "model.rank0.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
            if name.endswith(".qweight"):
                k8, n = f.get_slice(name).get_shape()
                shapes.add((n, k8 * 8))
    for n, k in sorted(shapes):
        prewarm(n, k, GROUP, torch.float16, device, max_m)


def run_one(label: str, ws: Path, args: argparse.Namespace, device: torch.device, cuda_graph: bool) -> dict:
    from lmd.turbomind.engine import Engine

    engine_options = dict(
        device=str(device),
        dtype=args.dtype,
        max_batch_size=max(args.concurrency, max(args.batch_sizes)),
        session_len=args.session_len,
        max_context_token_num=args.max_context_token_num,
        cuda_graph=cuda_graph,
    )
    result: dict = {"weights": label, "cuda_graph": cuda_graph}
    start = time.perf_counter()
    with Engine(ws, **engine_options) as engine:
        result["engine_start_s"] = time.perf_counter() - start
        result["decode_graphs"] = engine.runner.graphs is not None  # off on CPU whatever was asked
        facts = {"kv_blocks": engine.runner.num_blocks, "engine_options": engine_options}
        vocab = engine.workspace.model.vocab_size
        warm = random_requests(min(args.concurrency, args.num_prompts), args.input_len, 4, vocab, seed=10**6)
        run_throughput(engine, warm, args.concurrency)  # first-use costs (allocator, kernels) stay out of timing
        requests = random_requests(
            args.num_prompts, args.input_len, args.output_len, vocab, seed=args.seed, exclude=engine.eos_ids
        )
        print(
            f"[{label}] throughput: {args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out), "
            f"concurrency {args.concurrency}",
            flush=True,
        )
        run = run_throughput(engine, requests, args.concurrency)
        result["throughput"] = throughput_report(
            run, {**facts, "input_len": args.input_len, "output_len": args.output_len}
        )
        print(f"[{label}] latency: batch sizes {args.batch_sizes}", flush=True)
        config = LatencyConfig(
            args.input_len, args.output_len, tuple(args.batch_sizes), args.warmup, args.iters, args.seed
        )
        result["latency"] = latency_report(
            run_latency(engine, config),
            {
                **facts,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "iters": args.iters,
                "warmup": args.warmup,
            },
        )
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU with small defaults (script check)")
    p.add_argument("--weights", default="fp16,int4", help="comma list of fp16, int4")
    p.add_argument("--num-prompts", type=int, help="throughput requests (default 256; tiny 12)")
    p.add_argument("--concurrency", type=int, help="throughput requests in flight (default 64; tiny 4)")
    p.add_argument("--input-len", type=int, help="prompt tokens (default 256; tiny 24)")
    p.add_argument("--output-len", type=int, help="generated tokens per request (default 128; tiny 8)")
    p.add_argument("--batch-sizes", help="latency batch sizes (default 1,8,32,64; tiny 1,4)")
    p.add_argument("--iters", type=int, default=3, help="timed latency iterations per batch size")
    p.add_argument("--warmup", type=int, default=1, help="untimed latency iterations per batch size")
    p.add_argument("--session-len", type=int, default=4096)
    p.add_argument("--max-context-token-num", type=int, default=2048, help="prefill tokens per engine step")
    p.add_argument("--device", default=None, help="default cuda (tiny: cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graph", default="on", help="comma list of on, off: decode steps as CUDA graphs or eager")
    p.add_argument(
        "--tune-max-m",
        type=int,
        help="tune int4 plans up to this M bucket (default: the prefill budget); larger M runs the untuned default plan",
    )
    args = p.parse_args(argv)
    big = not args.tiny
    defaults = dict(
        num_prompts=256 if big else 12,
        concurrency=64 if big else 4,
        input_len=256 if big else 24,
        output_len=128 if big else 8,
        batch_sizes="1,8,32,64" if big else "1,4",
        device="cuda" if big else "cpu",
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    args.weights = args.weights.split(",")
    modes = {"on": True, "off": False}
    if any(m not in modes for m in args.cuda_graph.split(",")):
        raise SystemExit(f"--cuda-graph {args.cuda_graph}: use a comma list of on, off")
    args.cuda_graph = [modes[m] for m in args.cuda_graph.split(",")]
    if args.tiny:
        args.session_len, args.max_context_token_num = min(args.session_len, 256), min(args.max_context_token_num, 64)
    if args.tune_max_m is None:
        args.tune_max_m = args.max_context_token_num
    args.dtype = "fp32" if torch.device(args.device).type == "cpu" else "auto"  # CPU matmuls want fp32
    return args


def run_label(r: dict) -> str:
    return r["weights"] + (" graphs" if r["decode_graphs"] else " eager")


def print_summary(results: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(
        f"{'weights':11s} {'req/s':>8s} {'in tok/s':>10s} {'out tok/s':>10s} {'TTFT p50 ms':>12s} "
        f"{'TTFT p99 ms':>12s} {'TPOT p50 ms':>12s} {'preempt':>8s}"
    )
    for r in results:
        t = r["throughput"]
        print(
            f"{run_label(r):11s} {t['requests_per_s']:8.2f} {t['input_tokens_per_s']:10.1f} "
            f"{t['output_tokens_per_s']:10.1f} {t['ttft_ms']['median']:12.1f} {t['ttft_ms']['p99']:12.1f} "
            f"{t['tpot_ms']['median']:12.2f} {t['engine']['preemptions']:8d}"
        )
    print(
        f"\n{'weights':11s} {'batch':>6s} {'TTFT ms':>9s} {'decode ms/tok':>14s} {'ITL p99 ms':>11s} "
        f"{'tok/s':>9s} {'decode tok/s':>13s}"
    )
    for r in results:
        for b in r["latency"]["batches"]:
            print(
                f"{run_label(r):11s} {b['batch_size']:6d} {b['ttft_ms']['mean']:9.1f} "
                f"{b['decode_ms_per_token']['mean']:14.2f} {b['inter_token_ms']['p99']:11.2f} "
                f"{b['tokens_per_s']:9.1f} {b['decode_tokens_per_s']:13.1f}"
            )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    model_shape = TINY if args.tiny else LLAMA2_7B
    shape = "tiny" if args.tiny else "llama2-7b"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{shape} random weights on {gpu}, torch {torch.__version__}", flush=True)
    results = []
    for label in args.weights:
        if label not in ("fp16", "int4"):
            raise SystemExit(f"--weights {label}: use fp16 or int4")
        root = Path(tempfile.mkdtemp(prefix=f"lmd-engine-{label}-"))
        try:
            start = time.perf_counter()
            ws = build_workspace(root / "ws", model_shape, label == "int4", args.session_len, device)
            build_s = time.perf_counter() - start
            print(f"[{label}] workspace built in {build_s:.1f} s", flush=True)
            start = time.perf_counter()
            if label == "int4" and device.type == "cuda":
                prewarm_int4(ws, args.tune_max_m, device)
                if args.tune_max_m < args.max_context_token_num:  # larger buckets run the default plan, untuned
                    os.environ["LMD_W4A16_AUTOTUNE"] = "0"
            prewarm_s = time.perf_counter() - start
            for graph in args.cuda_graph:
                results.append({**run_one(label, ws, args, device, graph), "build_s": build_s, "prewarm_s": prewarm_s})
        finally:
            shutil.rmtree(root, ignore_errors=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", "."), "engine.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(dict(shape=shape, device=gpu, torch=torch.__version__, args=vars(args), results=results), indent=1)
    )
    print_summary(
        results,
        f"{shape}, {args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out), "
        f"concurrency {args.concurrency}; latency {args.iters} iters, {gpu} -> {out}",
    )


if __name__ == "__main__":
    main()
