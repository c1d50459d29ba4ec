"""Serving workloads beside LMDeploy's PyTorch engine and HF transformers, in one call (issue 14, 5b-5d).

    python3 benchmarks/serving_workloads.py --prepare .peers/serving_lengths.json     # here: data + tokenizer
    python3 benchmarks/serving_workloads.py --lengths .peers/serving_lengths.json --peers .peers   # on the GPU
    python3 benchmarks/serving_workloads.py --tiny --no-peer       # a tiny model on CPU: checks the script

Models (random weights, built as benchmarks/engine.py builds them; no checkpoint, no network): `llama3-8b`, a
Llama-3-8B shape (32 heads / 8 KV heads, hidden 4096, 32 layers, intermediate 14336, vocab 128256) run in bf16 (the
workspace is written fp16 and the engine casts it at load), and `llama2-7b`, fp16; `llama3-8b-fp8` and
`llama3-8b-int8` are the 8B shape with W8A8 linears (e4m3 / int8 per-channel weights, per-token dynamic activations;
lmd only: compare them with `llama3-8b` in the same call); `llama2-7b-int4` is the 7B shape with AWQ int4 g128
linears (W4A16, tuned for every step size before timing), which LMDeploy serves as an AutoAWQ checkpoint of the same
codes (HF transformers skipped). Prompts are random token ids of real lengths and every
request generates exactly its output length (EOS ignored), so random weights do real work.

Lengths, counted with SmolLM2's tokenizer (the shared GGUF): the ShareGPT first-turn prompts of `<data>/sharegpt/`
(de-duplicated, in a seeded shuffle; prompts outside 4-1024 tokens skipped, as `lmd bench throughput` does) and the
805 AlpacaEval reference outputs (`<data>/chat_prompts/alpaca_eval.jsonl`, in a second seeded shuffle). The i-th
prompt is paired with the i-th output length (i mod 805: every length is used once before any twice), the output
clipped to the session (prompt + output < session_len). MT-bench (`mt_bench_question.jsonl`): the first turn's tokens
through the chat template, and the tokens the second turn adds after the reply (template included). The GPU machine has
neither the data nor the GGUF reader, so `--prepare FILE` counts them here and `--lengths FILE` reads them there.

Workloads (`--workloads`):
- real (5b): every request submitted at once, max batch 256, on lmd's engine, on LMDeploy 0.18 PT (a child process on
  the same weights turned back into an HF checkpoint, fed token ids, as benchmarks/decode_vs_lmdeploy.py runs it) and
  on HF transformers `generate` in static padded batches of 64 (only the first `--hf-requests`; each request's own
  output length counts as useful tokens, the padding steps do not). Output tok/s, requests/s, total time, ratios.
  `--real-kv-int8`: then again on an lmd engine with online int8 KV (`quant_policy=4`, the pool in the same share of
  memory), "lmd KV int8": at these lengths attention reads the KV and is about half of a full step of a model without
  GQA (docs/benchmarks.md, twenty-sixth session), so this is what int8 KV adds to a W4A16 deployment.
- kv-int8 (5c): lmd only; the KV pool sized to `--kv-cache-tokens` of fp16 KV, so the running batch is capped well
  below the requests in flight, against `quant_policy=4` (online int8 KV) in the same bytes (`kv_cache.block_bytes`:
  1.94x the blocks at head_dim 128), on `--kv-requests` requests (the real lengths cycled, fresh ids: 2048, so that
  the pool caps the batch for most of the run rather than only until the longest replies are left). Requests/s and
  the mean running batch (engine.stats() polled every 10 ms).
- prefix (5d): lmd only; MT-bench's 80 conversations. Turn 1 (all at once, `--prefix-reply-len` tokens each), then
  turn 2 = turn-1 prompt + the reply's token ids + the second question, one at a time and all at once; TTFT with the
  prefix cache on and off, prefix-hit tokens from engine.stats(). lmd has no switch for the prefix cache, so "off"
  changes the first token of each second-turn prompt: no cached block matches, the same tokens are computed.

A phase starts only while the run is within `--budget-s` and its workload within `--limit-s`; a failed phase is
recorded and the run goes on. Results are written after every phase to `<out>/serving_workloads.json` (`--out`,
default $OUT, else .); per-phase wall times are printed as they end; a table comes last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import json
import os
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode_vs_lmdeploy import (  # noqa: E402
    install_lmdeploy,
    lmdeploy_env,
    run_child,
    write_awq_checkpoint,
    write_hf_checkpoint,
)
from engine import LLAMA2_7B, SHAPE_KEYS, TINY, build_workspace, prewarm_int4  # noqa: E402
from step_trace import StepTrace  # noqa: E402

from lmd.bench.report import ms_summary, throughput_report  # noqa: E402
from lmd.bench.sampling import BenchRequest  # noqa: E402
from lmd.bench.stats import summarize  # noqa: E402
from lmd.bench.throughput import run_throughput  # noqa: E402
from lmd.bench.timeline import generation_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LLAMA3_8B = dict(zip(SHAPE_KEYS, (4096, 14336, 32, 32, 8), strict=True), vocab_size=128256)
WORKLOADS = ("real", "kv-int8", "prefix")
FIRST_ID = 3  # the synthetic tokenizer's <unk>, <s>, </s> are 0, 1, 2: random prompts never hold them
PAD_ID = 0
MIN_PROMPT, MAX_PROMPT = 4, 1024
LMDEPLOY = "LMDeploy 0.18 PT"
HF = "HF transformers"


@dataclass(frozen=True)
class ModelSpec:
    shape: dict[str, int]
    dtype: str  # the engines' compute dtype: fp16, bf16 or fp32
    w8a8: str | None = None  # int8 / fp8: W8A8 linears (per-channel weights, per-token activations); None: float
    int4: bool = False  # W4A16: AWQ int4 g128 linears (LMDeploy serves the same codes as an AutoAWQ checkpoint)


MODELS = {"llama3-8b": ModelSpec(LLAMA3_8B, "bf16"), "llama2-7b": ModelSpec(LLAMA2_7B, "fp16"),
          "llama3-8b-fp8": ModelSpec(LLAMA3_8B, "bf16", "fp8"), "llama3-8b-int8": ModelSpec(LLAMA3_8B, "bf16", "int8"),
          "llama2-7b-int4": ModelSpec(LLAMA2_7B, "fp16", int4=True)}
TINY_MODEL = ModelSpec(TINY, "fp32")
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Settings:
    """What every engine of a run shares (flags of the same names)."""

    device: str
    session_len: int
    max_batch_size: int
    prefill_tokens: int  # lmd max_context_token_num = LMDeploy max_prefill_token_num
    cache_fraction: float  # KV pool of the real and prefix workloads, both engines: this share of free memory
    block_len: int
    max_prompt_len: int
    max_output_len: int
    seed: int
    tp: int = 1  # lmd's tensor-parallel ranks (GPUs 0 .. tp - 1)

    def engine_options(self, dtype: str, **changes: Any) -> dict[str, Any]:
        options = dict(device=self.device, dtype=dtype, max_batch_size=self.max_batch_size,
                       session_len=self.session_len, max_context_token_num=self.prefill_tokens,
                       cache_max_entry_count=self.cache_fraction, cache_block_seq_len=self.block_len, tp=self.tp)
        return options | changes


@dataclass(frozen=True)
class Lengths:
    """Token counts of the real workloads: (prompt, output) per request and (first turn, second-turn addition) per
    MT-bench conversation, in the pairing the module doc describes."""

    requests: tuple[tuple[int, int], ...]
    conversations: tuple[tuple[int, int], ...]
    source: dict[str, Any]


# ---- lengths ----


def count_lengths(data_dir: Path, tokenizer_path: str, num_requests: int, seed: int) -> Lengths:
    from lmd.bench.dataset import dataset_files, read_conversations
    from lmd.model_source import ModelSource, load_tokenizer, resolve_model

    # a tokenizer directory needs no config.json, which resolve_model asks of a model directory
    source = resolve_model(tokenizer_path) if tokenizer_path.endswith(".gguf") else ModelSource(tokenizer_path)
    tokenizer = load_tokenizer(source)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    files = dataset_files("sharegpt", data_dir)
    prompts = [c.prompt for c in read_conversations(files)]
    random.Random(seed).shuffle(prompts)
    prompt_lens: list[int] = []
    for text in prompts:
        if len(prompt_lens) == num_requests:
            break
        if MIN_PROMPT <= (n := count(text)) <= MAX_PROMPT:
            prompt_lens.append(n)
    if len(prompt_lens) < num_requests:
        raise SystemExit(f"only {len(prompt_lens)} ShareGPT prompts of {MIN_PROMPT}-{MAX_PROMPT} tokens in "
                         f"{data_dir}/sharegpt; lower --num-requests")
    alpaca = data_dir / "chat_prompts" / "alpaca_eval.jsonl"
    outputs = [count(json.loads(line)["output"]) for line in alpaca.read_text().splitlines() if line.strip()]
    random.Random(seed + 1).shuffle(outputs)
    requests = tuple((p, max(1, outputs[i % len(outputs)])) for i, p in enumerate(prompt_lens))
    mt_bench = data_dir / "chat_prompts" / "mt_bench_question.jsonl"
    turns = [json.loads(line)["turns"] for line in mt_bench.read_text().splitlines() if line.strip()]
    conversations = tuple(turn_lengths(tokenizer, count, t[0], t[1]) for t in turns)
    source = {"sharegpt": [str(f) for f in files], "alpaca_eval": str(alpaca), "mt_bench": str(mt_bench),
              "tokenizer": tokenizer_path, "seed": seed, "chat_template": bool(getattr(tokenizer, "chat_template", None)),
              "pairing": f"i-th drawn ShareGPT prompt, (i mod {len(outputs)})-th AlpacaEval output length of a "
                         "seeded shuffle"}
    return Lengths(requests, conversations, source)


def turn_lengths(tokenizer: Any, count: Callable[[str], int], first: str, second: str) -> tuple[int, int]:
    """(tokens of turn 1 with the generation prompt, tokens turn 2 adds after the reply) through the chat template;
    plain token counts for a tokenizer without one."""
    if not getattr(tokenizer, "chat_template", None):
        return count(first), count(second)

    def templated(messages: list[dict[str, str]], generation_prompt: bool) -> int:
        return count(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False))

    user1, reply, user2 = ({"role": "user", "content": first}, {"role": "assistant", "content": "x"},
                           {"role": "user", "content": second})
    turn1 = templated([user1], True)
    return turn1, templated([user1, reply, user2], True) - turn1 - count("x")


def save_lengths(lengths: Lengths, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(lengths)))


def load_lengths(path: Path) -> Lengths:
    raw = json.loads(path.read_text())
    return Lengths(tuple(map(tuple, raw["requests"])), tuple(map(tuple, raw["conversations"])), raw["source"])


def length_stats(values: Sequence[int]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "total": sum(values)}


# ---- requests ----


def random_ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ID, vocab) for _ in range(n))


def clipped(prompt: int, output: int, settings: Settings) -> tuple[int, int]:
    """Lengths clipped to the flags and to the session (prompt + output < session_len, LMDeploy's rule)."""
    prompt = min(prompt, settings.max_prompt_len, settings.session_len // 2)
    return prompt, max(1, min(output, settings.max_output_len, settings.session_len - prompt - 1))


def real_requests(lengths: Sequence[tuple[int, int]], settings: Settings, vocab: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for prompt, output in lengths:
        prompt, output = clipped(prompt, output, settings)
        out.append(BenchRequest(random_ids(rng, prompt, vocab), output, exact=True))
    return out


def warmup_requests(requests: Sequence[BenchRequest], vocab: int, count: int, seed: int) -> list[BenchRequest]:
    """The first prompt lengths with other ids (so the prefix cache cannot serve the timed run), 16 tokens each:
    `count` at least twice the batch, so that full-budget prefill steps and mixed steps at a full batch run before
    the timing (their first runs pay one-time costs: ~4 s on the H200, docs/benchmarks.md, twelfth session)."""
    rng = random.Random(seed)
    return [BenchRequest(random_ids(rng, r.prompt_len, vocab), min(16, r.output_len), True) for r in requests[:count]]


# ---- phases ----


class Phases:
    """The run's budget and per-workload limits (per model), per-phase wall times, results saved after each phase."""

    def __init__(self, budget_s: float, limits: dict[str, float], results: dict[str, Any], out: Path) -> None:
        self.start, self.budget_s, self.limits = time.perf_counter(), budget_s, limits
        self.results, self.out = results, out
        self.used: dict[tuple[str, str], float] = {}
        results["phases"] = []

    def left(self, model: str, workload: str) -> float:
        run_left = self.budget_s - (time.perf_counter() - self.start)
        return min(run_left, self.limits.get(workload, float("inf")) - self.used.get((model, workload), 0.0))

    def run(self, model: str, workload: str, label: str, fn: Callable[[float], dict[str, Any]]) -> dict[str, Any]:
        """fn(seconds left) -> its results; a phase out of time is skipped, a failing one recorded as failed."""
        left = self.left(model, workload)
        name = f"{model} {workload}: {label}"
        if left <= 0:
            print(f"[{name}] skipped: out of time", flush=True)
            self.results["phases"].append({"phase": name, "skipped": True})
            return {"skipped": "out of time (--budget-s / --limit-s)"}
        print(f"[{name}] ...", flush=True)
        start = time.perf_counter()
        try:
            result = fn(left)
        except Exception as exc:  # one failed phase must not cost the others' figures
            traceback.print_exc()
            result = {"failed": f"{type(exc).__name__}: {exc}"}
        wall = time.perf_counter() - start
        self.used[(model, workload)] = self.used.get((model, workload), 0.0) + wall
        self.results["phases"].append({"phase": name, "wall_s": wall, "ok": "failed" not in result})
        print(f"[{name}] {wall:.1f} s{'  FAILED: ' + result['failed'] if 'failed' in result else ''}", flush=True)
        return result

    def note(self, name: str, wall_s: float) -> None:
        self.results["phases"].append({"phase": name, "wall_s": wall_s})
        print(f"[{name}] {wall_s:.1f} s", flush=True)

    def save(self) -> None:
        self.results["elapsed_s"] = time.perf_counter() - self.start
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.results, indent=1))


def free_device_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def lmd_engine(ws: Path, options: dict[str, Any], phases: Phases, name: str) -> Iterator[Any]:
    from lmd.turbomind.engine import Engine

    free_device_memory(options["device"])  # a previous engine's pool, once its last reference is gone
    start = time.perf_counter()
    engine = Engine(ws, **options)
    phases.note(f"{name}: lmd engine start ({engine.stats().blocks_total} KV blocks)", time.perf_counter() - start)
    try:
        yield engine
    finally:
        engine.close()
        del engine
        free_device_memory(options["device"])


# ---- 5b: real lengths ----


def requested(requests: Sequence[BenchRequest]) -> dict[str, int]:
    return {"requested_output_tokens": sum(r.output_len for r in requests),
            "input_tokens_requested": sum(r.prompt_len for r in requests)}


def lmd_real(engine: Any, options: dict[str, Any], requests: list[BenchRequest], warmup: list[BenchRequest],
             during: contextlib.AbstractContextManager[Any] | None = None) -> dict[str, Any]:
    """Every request at once after a warm-up; `during` (a poller) is entered around the timed run only."""
    run_throughput(engine, warmup, len(warmup))  # first-use costs (allocator, kernels) stay out of timing
    profiler = cProfile.Profile() if PROFILE_HOST else None
    with during if during is not None else contextlib.nullcontext(), StepTrace(engine) as trace:
        if profiler is not None:
            profiler.enable()
        run = run_throughput(engine, requests, len(requests))
        if profiler is not None:
            profiler.disable()
    facts = {"kv_blocks": engine.stats().blocks_total, "engine_options": options}
    report = throughput_report(run, facts) | requested(requests) | {"step_trace": trace.summary()}
    if profiler is not None:
        report["host_profile"] = host_profile(profiler, trace.summary().get("steps", 0))
    return report


PROFILE_HOST = False  # --profile-host


def host_profile(profiler: cProfile.Profile, steps: int, top: int = 30) -> list[dict[str, Any]]:
    """The functions with the most own time in the timed run, per engine step (cProfile: the calling thread on
    Python < 3.12; every thread from 3.12, where it runs on sys.monitoring)."""
    stats = pstats.Stats(profiler)
    rows = sorted(((fn, st[2], st[3], st[1]) for fn, st in stats.stats.items()), key=lambda r: -r[1])[:top]
    per = max(1, steps)
    return [dict(function=f"{Path(fn[0]).name}:{fn[1]} {fn[2]}", own_ms_per_step=tt * 1e3 / per,
                 cum_ms_per_step=ct * 1e3 / per, calls_per_step=n / per) for fn, tt, ct, n in rows]


def hf_generate(model: Any, batch: Sequence[BenchRequest], device: str) -> float:
    """One static batch, left-padded: every row generates the batch's longest output (EOS cannot stop it)."""
    width, new = max(r.prompt_len for r in batch), max(r.output_len for r in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(batch):
        ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_ids)
        mask[row, width - r.prompt_len:] = 1
    if device == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=PAD_ID)
    if device == "cuda":
        torch.cuda.synchronize()
    if out.shape[1] != width + new:
        raise RuntimeError(f"HF generate returned {out.shape[1] - width} new tokens, asked for {new}")
    return time.perf_counter() - began


def hf_static(hf_dir: Path, requests: list[BenchRequest], batch_size: int, dtype: str, device: str,
              left_s: float) -> dict[str, Any]:
    """HF transformers static batching over the first requests, batch after batch until they or the time run out."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    free_device_memory(device)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=TORCH_DTYPES[dtype]).to(device).eval()
    load_s = time.perf_counter() - start
    hf_generate(model, [BenchRequest(r.prompt_ids[:8], 2, True) for r in requests[:2]], device)  # warm-up
    done: list[BenchRequest] = []
    batches: list[dict[str, Any]] = []
    for first in range(0, len(requests), batch_size):
        if time.perf_counter() - start > left_s:
            break
        batch = requests[first:first + batch_size]
        batches.append({"requests": len(batch), "max_prompt": max(r.prompt_len for r in batch),
                        "max_output": max(r.output_len for r in batch), "s": hf_generate(model, batch, device)})
        done += batch
    del model
    free_device_memory(device)
    total_s, useful = sum(b["s"] for b in batches), sum(r.output_len for r in done)
    return {"requests": len(done), "requests_asked": len(requests), "batch_size": batch_size, "load_s": load_s,
            "total_s": total_s, "output_tokens": useful,
            "padded_output_tokens": sum(b["requests"] * b["max_output"] for b in batches),
            "requests_per_s": len(done) / total_s if total_s else 0.0,
            "output_tokens_per_s": useful / total_s if total_s else 0.0, "batches": batches} | requested(done)


def write_peer_checkpoint(ws: Path, out: Path, spec: ModelSpec, session_len: int) -> Path:
    """The workspace as an HF Llama directory, in the model's dtype and context (LMDeploy and transformers read it);
    an int4 one as an AutoAWQ checkpoint of the same codes (LMDeploy's AWQ path)."""
    if spec.int4:
        return write_awq_checkpoint(ws, out, spec.shape, session_len)
    return write_hf_checkpoint(ws, out, spec.shape, session_len, str(TORCH_DTYPES[spec.dtype]).removeprefix("torch."))


def run_lmdeploy(hf_dir: Path, requests: list[BenchRequest], warmup: list[BenchRequest], settings: Settings,
                 args: argparse.Namespace, left_s: float) -> dict[str, Any]:
    not_ready = install_lmdeploy(args.peers)
    if not_ready is not None:
        return not_ready
    free_device_memory(settings.device)  # what the last lmd engine left in torch's cache is LMDeploy's free memory
    folder = Path(tempfile.mkdtemp())
    spec = {"hf_dir": str(hf_dir), "out": str(folder / "result.json"),
            "requests": [[list(r.prompt_ids), r.output_len] for r in requests],
            "warmup": [[list(r.prompt_ids), r.output_len] for r in warmup],
            "engine": {"max_batch_size": settings.max_batch_size, "session_len": settings.session_len,
                       "cache_max_entry_count": settings.cache_fraction,
                       "max_prefill_token_num": settings.prefill_tokens, "block_size": settings.block_len}}
    (folder / "spec.json").write_text(json.dumps(spec))
    result = run_child([sys.executable, __file__, "--lmdeploy-child", str(folder / "spec.json")],
                       folder / "result.json", round(max(1.0, min(args.peer_timeout, left_s))), lmdeploy_env())
    return result if "failed" in result else result | requested(requests)


def lmdeploy_child(spec_path: str) -> None:
    """Runs in the child process (LMDeploy on its path): warm-up, then every request at once, streamed."""
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline

    spec = json.loads(Path(spec_path).read_text())
    start = time.perf_counter()
    pipe = pipeline(spec["hf_dir"], backend_config=PytorchEngineConfig(tp=1, **spec["engine"]))
    start_s = time.perf_counter() - start
    session = iter(range(1, 10**9))

    async def one(ids: list[int], n: int) -> tuple[float | None, int]:
        gen = GenerationConfig(max_new_tokens=n, ignore_eos=True, do_sample=False)
        submitted, first, count = time.perf_counter(), None, 0
        async for out in pipe.generate(messages=None, session_id=next(session), gen_config=gen, input_ids=ids,
                                       stream_response=True, do_preprocess=False):
            if out.generate_token_len and first is None:
                first = time.perf_counter() - submitted
            count = out.generate_token_len
        return first, count

    async def run_all(requests: list[list]) -> tuple[float, list[tuple[float | None, int]]]:
        began = time.perf_counter()
        results = await asyncio.gather(*(one(ids, n) for ids, n in requests))
        return time.perf_counter() - began, results

    pipe._run(coro=run_all(spec["warmup"])).result()
    total_s, results = pipe._run(coro=run_all(spec["requests"])).result()
    pipe.close()
    tokens = sum(count for _, count in results)
    short = sum(count != n for (_, count), (_, n) in zip(results, spec["requests"], strict=True))
    report = {"engine_start_s": start_s, "engine": spec["engine"], "requests": len(results), "total_s": total_s,
              "requests_per_s": len(results) / total_s, "output_tokens": tokens, "output_tokens_per_s": tokens / total_s,
              "input_tokens": sum(len(ids) for ids, _ in spec["requests"]), "requests_not_exact": short,
              "ttft_ms": ms_summary(summarize([t for t, _ in results if t is not None]))}
    Path(spec["out"]).write_text(json.dumps(report))


KV_INT8 = "lmd KV int8"


def ratios(real: dict[str, Any]) -> dict[str, float]:
    lmd = real.get("lmd", {}).get("output_tokens_per_s")
    out = {}
    for system, key in ((LMDEPLOY, "lmd_over_lmdeploy"), (HF, "lmd_over_hf")):
        other = real.get(system, {}).get("output_tokens_per_s")
        if lmd and other:
            out[key] = lmd / other
    if lmd and (int8 := real.get(KV_INT8, {}).get("output_tokens_per_s")):
        out["kv_int8_over_lmd"] = int8 / lmd
    return out


# ---- 5c: KV int8 at a memory-bound load ----


class RunningBatch:
    """Polls engine.stats() while a run is in flight: the running batch over time, and the waiting queue."""

    def __init__(self, engine: Any, interval_s: float = 0.01) -> None:
        self.engine, self.interval_s = engine, interval_s
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            stats = self.engine.stats()
            self.samples.append((stats.running, stats.waiting))

    def __enter__(self) -> RunningBatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def report(self) -> dict[str, float]:
        running = [r for r, _ in self.samples if r] or [0]
        return {"mean_running_batch": statistics.fmean(running), "max_running_batch": max(running),
                "samples": len(self.samples)}


def kv_blocks(spec: ModelSpec, settings: Settings, cache_tokens: int) -> dict[str, int]:
    """Block counts of float (compute dtype) KV and of online int8 KV in the same bytes, and those bytes."""
    from lmd.turbomind.kv_cache import block_bytes

    shape = spec.shape
    dims = (shape["num_hidden_layers"], settings.block_len, shape["num_key_value_heads"],
            shape["hidden_size"] // shape["num_attention_heads"])
    dtype = TORCH_DTYPES[spec.dtype]
    float_bytes, int8_bytes = block_bytes(*dims, dtype, False, False), block_bytes(*dims, dtype, True, False)
    blocks = max(2, -(-cache_tokens // settings.block_len))
    return {"float": blocks, "int8": blocks * float_bytes // int8_bytes, "bytes": blocks * float_bytes}


def lmd_kv_run(run: ModelRun, requests: list[BenchRequest], warmup: list[BenchRequest], blocks: int,
               quant_policy: int) -> dict[str, Any]:
    options = run.settings.engine_options(run.spec.dtype, cache_max_entry_count=float(blocks),
                                          quant_policy=quant_policy)
    with lmd_engine(run.ws, options, run.phases, run.name) as engine:
        poll = RunningBatch(engine)
        report = lmd_real(engine, options, requests, warmup, during=poll)
    counts = report["engine"]
    return report | poll.report() | {"generated_per_step": counts["generated_tokens"] / max(1, counts["steps"])}


# ---- 5d: prefix reuse on MT-bench ----


async def generate_all(engine: Any, requests: Sequence[BenchRequest]) -> list[list[int]]:
    async def one(request: BenchRequest) -> list[int]:
        ids: list[int] = []
        async for delta in engine.generate(list(request.prompt_ids), generation_config(request)):
            ids.extend(delta.token_ids)
        return ids

    return list(await asyncio.gather(*(one(r) for r in requests)))


def second_turns(engine: Any, conversations: Sequence[tuple[int, int]], settings: Settings, reply_len: int,
                 turn2_len: int, vocab: int, seed: int, cached: bool) -> list[BenchRequest]:
    """Turn 1 of every conversation run at once; each turn 2 = turn-1 prompt + reply ids + the second question."""
    rng = random.Random(seed)
    firsts, tails = [], []
    for first, second in conversations:
        first = min(first, settings.max_prompt_len)
        room = settings.session_len - first - reply_len - turn2_len - 1
        firsts.append(BenchRequest(random_ids(rng, first, vocab), reply_len, True))
        tails.append(random_ids(rng, max(1, min(second, room)), vocab))
    replies = asyncio.run(generate_all(engine, firsts))
    turns = []
    for turn1, reply, tail in zip(firsts, replies, tails, strict=True):
        history = list(turn1.prompt_ids) + reply
        if not cached:  # a different first token: no block of the history matches any cached one
            history[0] = FIRST_ID + (history[0] - FIRST_ID + 1) % (vocab - FIRST_ID)
        turns.append(BenchRequest(tuple(history) + tail, turn2_len, True))
    return turns


def lmd_prefix(engine: Any, conversations: Sequence[tuple[int, int]], settings: Settings, args: argparse.Namespace,
               vocab: int) -> dict[str, Any]:
    out: dict[str, Any] = {"conversations": len(conversations), "reply_len": args.prefix_reply_len,
                           "turn2_output_len": args.prefix_turn2_len}
    for seed, (cache, submit) in enumerate((c, s) for c in ("off", "on") for s in ("sequential", "concurrent")):
        turns = second_turns(engine, conversations, settings, args.prefix_reply_len, args.prefix_turn2_len, vocab,
                             settings.seed + 100 + seed, cache == "on")
        run = run_throughput(engine, turns, 1 if submit == "sequential" else len(turns))
        growth = run.engine_counters
        out.setdefault(cache, {})[submit] = {
            "requests": len(turns), "prompt_tokens": sum(t.prompt_len for t in turns), "total_s": run.total_s,
            "ttft_ms": ms_summary(run.ttft()),
            "prefix_hit_tokens": growth["prefix_hit_tokens"], "computed_tokens": growth["computed_tokens"],
            "cached_tokens_usage": sum(t.cached_tokens for t in run.timelines),
            "output_tokens": run.output_tokens}
    for submit in ("sequential", "concurrent"):
        off, on = out["off"][submit]["ttft_ms"], out["on"][submit]["ttft_ms"]
        if off and on and on["mean"]:
            out[f"ttft_mean_off_over_on_{submit}"] = off["mean"] / on["mean"]
    return out


# ---- one model ----


@dataclass(frozen=True)
class ModelRun:
    """What the phases of one model share."""

    name: str
    spec: ModelSpec
    ws: Path
    requests: list[BenchRequest]
    warmup: list[BenchRequest]
    lengths: Lengths
    settings: Settings
    args: argparse.Namespace
    phases: Phases
    results: dict[str, Any]

    @property
    def vocab(self) -> int:
        return self.spec.shape["vocab_size"]


def run_model(name: str, spec: ModelSpec, lengths: Lengths, settings: Settings, args: argparse.Namespace,
              phases: Phases) -> None:
    results: dict[str, Any] = {"shape": spec.shape, "dtype": spec.dtype, "w8a8": spec.w8a8, "int4": spec.int4}
    phases.results["models"][name] = results
    vocab = spec.shape["vocab_size"]
    requests = real_requests(lengths.requests[:args.num_requests], settings, vocab, settings.seed)
    if args.shard is not None:  # one data-parallel replica's share, as a round-robin balancer deals them
        index, count = args.shard
        requests = requests[index::count]
    warmup = warmup_requests(requests, vocab, min(2 * settings.max_batch_size, len(requests)), settings.seed + 1)
    results["requests"] = {"prompt": length_stats([r.prompt_len for r in requests]),
                           "output": length_stats([r.output_len for r in requests])}
    if phases.left(name, "") <= 0:
        print(f"[{name}] skipped: out of time", flush=True)
        results["skipped"] = "out of time (--budget-s)"
        return
    root = Path(tempfile.mkdtemp(prefix=f"lmd-serving-{name}-", dir=os.environ.get("TMPDIR")))
    try:
        start = time.perf_counter()
        ws = build_workspace(root / "ws", spec.shape, spec.int4, settings.session_len, torch.device(settings.device),
                             w8a8=spec.w8a8)
        phases.note(f"{name}: workspace built", time.perf_counter() - start)
        if spec.int4 and settings.device == "cuda":  # W4A16 tuning of every M bucket a step can have, before timing
            start = time.perf_counter()
            prewarm_int4(ws, settings.prefill_tokens + settings.max_batch_size, torch.device(settings.device))
            phases.note(f"{name}: W4A16 plans tuned", time.perf_counter() - start)
        run = ModelRun(name, spec, ws, requests, warmup, lengths, settings, args, phases, results)
        if "real" in args.workloads:
            results["real"] = {}
        if {"real", "prefix"} & set(args.workloads):
            lmd_phases(run)
        if "real" in args.workloads and args.real_kv_int8:
            lmd_real_kv_int8(run)
        if "real" in args.workloads:
            peer_phases(run, root / "hf")
            results["real"]["ratios"] = ratios(results["real"])
        if "kv-int8" in args.workloads:
            kv_phases(run)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        free_device_memory(settings.device)


def lmd_phases(run: ModelRun) -> None:
    """The real and prefix workloads on one lmd engine (its start-up paid once)."""
    args, phases, results = run.args, run.phases, run.results
    options = run.settings.engine_options(run.spec.dtype)
    try:
        with lmd_engine(run.ws, options, phases, run.name) as engine:
            if "real" in args.workloads:
                results["real"]["lmd"] = phases.run(run.name, "real", "lmd",
                                                    lambda _: lmd_real(engine, options, run.requests, run.warmup))
                phases.save()
                default = engine.scheduler.step_length
                lengths = [(r.prompt_len, r.output_len) for r in run.requests]
                for i, length in enumerate(args.lmd_step_lengths):  # the admission interval, on the running scheduler
                    engine.scheduler.step_length = length
                    label = f"lmd step_length={length}"
                    # the same lengths, other token ids: no prefix-cache hit on the earlier runs' prompts
                    again = real_requests(lengths, run.settings, run.vocab, run.settings.seed + 100 + i)
                    results["real"][label] = phases.run(
                        run.name, "real", label, lambda _, again=again, length=length: lmd_real(
                            engine, options | {"step_length": length}, again, run.warmup))
                    phases.save()
                engine.scheduler.step_length = default
            if "prefix" in args.workloads:
                conversations = run.lengths.conversations[:args.prefix_conversations]
                results["prefix"] = phases.run(run.name, "prefix", "lmd, cache off and on", lambda _: lmd_prefix(
                    engine, conversations, run.settings, args, run.vocab))
                phases.save()
    except Exception as exc:  # the engine did not start: its workloads say why, the peers still run
        traceback.print_exc()
        failed = {"failed": f"lmd engine: {type(exc).__name__}: {exc}"}
        if "real" in args.workloads:
            results["real"].setdefault("lmd", failed)
        if "prefix" in args.workloads:
            results.setdefault("prefix", failed)


def lmd_real_kv_int8(run: ModelRun) -> None:
    """The real workload on a second lmd engine, with online int8 KV (quant_policy 4) in the same share of memory."""
    options = run.settings.engine_options(run.spec.dtype, quant_policy=4)
    real = run.results["real"]
    if run.phases.left(run.name, "real") <= 0:  # skipped before its engine starts: the peers keep their time
        real[KV_INT8] = run.phases.run(run.name, "real", KV_INT8, lambda _: {})
        return
    try:
        with lmd_engine(run.ws, options, run.phases, f"{run.name} KV int8") as engine:
            real[KV_INT8] = run.phases.run(run.name, "real", KV_INT8,
                                           lambda _: lmd_real(engine, options, run.requests, run.warmup))
    except Exception as exc:  # the engine did not start: the row says why, the peers still run
        traceback.print_exc()
        real[KV_INT8] = {"failed": f"lmd engine: {type(exc).__name__}: {exc}"}
    run.phases.save()


def peer_phases(run: ModelRun, hf_dir: Path) -> None:
    """LMDeploy and HF transformers on the real workload, from the workspace turned back into an HF checkpoint."""
    args, phases, real = run.args, run.phases, run.results["real"]
    hf = bool(args.hf_requests) and run.name in args.hf_models and not run.spec.int4  # transformers: no AWQ here
    if run.spec.w8a8:  # the peers run float checkpoints: compare a W8A8 model with its float twin instead
        return
    if (args.no_peer and not hf) or phases.left(run.name, "real") <= 0:
        return
    start = time.perf_counter()
    write_peer_checkpoint(run.ws, hf_dir, run.spec, run.settings.session_len)
    phases.note(f"{run.name}: HF checkpoint written", time.perf_counter() - start)
    try:
        if not args.no_peer:
            real[LMDEPLOY] = phases.run(run.name, "real", LMDEPLOY, lambda left: run_lmdeploy(
                hf_dir, run.requests, run.warmup, run.settings, args, left))
            phases.save()
        if hf:
            real[HF] = phases.run(run.name, "real", HF, lambda left: hf_static(
                hf_dir, run.requests[:args.hf_requests], args.hf_batch_size, run.spec.dtype, run.settings.device,
                left))
            phases.save()
    finally:
        shutil.rmtree(hf_dir, ignore_errors=True)


def kv_phases(run: ModelRun) -> None:
    """The same requests on a float KV pool and on an int8 one of the same bytes."""
    args, phases = run.args, run.phases
    blocks = kv_blocks(run.spec, run.settings, args.kv_cache_tokens)
    # the real lengths cycled: enough requests that the KV pool caps the batch for most of the run, not only until
    # the few longest replies are left (512 requests: ~70 % of the steps were that tail)
    pool = run.lengths.requests
    lengths = [pool[i % len(pool)] for i in range(args.kv_requests)]
    requests = real_requests(lengths, run.settings, run.vocab, run.settings.seed + 2)
    warmup = warmup_requests(requests, run.vocab, min(8, len(requests)), run.settings.seed + 3)
    kv: dict[str, Any] = {"cache_tokens_float": args.kv_cache_tokens, "blocks": blocks}
    run.results["kv-int8"] = kv
    for label, policy in (("float", 0), ("int8", 4)):
        def one(_: float, label: str = label, policy: int = policy) -> dict[str, Any]:
            return lmd_kv_run(run, requests, warmup, blocks[label], policy)

        kv[label] = phases.run(run.name, "kv-int8", f"lmd KV {label}", one)
        phases.save()
    if kv["float"].get("requests_per_s") and kv["int8"].get("requests_per_s"):
        kv["int8_over_float_requests_per_s"] = kv["int8"]["requests_per_s"] / kv["float"]["requests_per_s"]


# ---- report ----


def _f(value: Any, digits: int = 1) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:,.{digits}f}"


def print_tables(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    phases = Table(title=f"phases (wall s), {results['elapsed_s']:.0f} s in all")
    for col in ("phase", "s"):
        phases.add_column(col, justify="right" if col == "s" else "left")
    for p in results["phases"]:
        phases.add_row(p["phase"], "skipped" if p.get("skipped") else _f(p.get("wall_s")))
    console.print(phases)
    table = Table(title=f"serving workloads, {results['gpu']} -> {results['out']}")
    for col in ("model", "workload", "system", "requests", "out tokens", "total s", "req/s", "out tok/s",
                "TTFT mean ms", "notes"):
        table.add_column(col, justify="left" if col in ("model", "workload", "system", "notes") else "right")
    for model, r in results["models"].items():
        for system, s in r.get("real", {}).items():
            if system == "ratios":
                continue
            note = s.get("skipped") or s.get("failed") or ""
            if system == "lmd":
                names = {"lmd_over_lmdeploy": "LMDeploy", "lmd_over_hf": "HF"}
                note = ", ".join(f"{v:.2f}x {names[k]}" for k, v in r["real"]["ratios"].items() if k in names)
            elif system == KV_INT8 and "kv_int8_over_lmd" in r["real"]["ratios"]:
                note = f"{r['real']['ratios']['kv_int8_over_lmd']:.2f}x lmd (float KV)"
            table.add_row(model, "real", system, str(s.get("requests", "-")), _f(s.get("output_tokens"), 0),
                          _f(s.get("total_s"), 2), _f(s.get("requests_per_s"), 2), _f(s.get("output_tokens_per_s")),
                          _f((s.get("ttft_ms") or {}).get("mean")), note)
        kv = r.get("kv-int8", {})
        for label in ("float", "int8"):
            s = kv.get(label)
            if s is None:
                continue
            note = s.get("skipped") or s.get("failed") or (
                f"{kv['blocks'][label]} blocks, mean batch {_f(s.get('mean_running_batch'))}, "
                f"preempt {s.get('engine', {}).get('preemptions', '-')}")
            if label == "int8" and "int8_over_float_requests_per_s" in kv:
                note += f", {kv['int8_over_float_requests_per_s']:.2f}x req/s"
            table.add_row(model, "kv-int8", f"lmd KV {label}", str(s.get("requests", "-")),
                          _f(s.get("output_tokens"), 0), _f(s.get("total_s"), 2), _f(s.get("requests_per_s"), 2),
                          _f(s.get("output_tokens_per_s")), _f((s.get("ttft_ms") or {}).get("mean")), note)
        prefix = r.get("prefix", {})
        for cache in ("off", "on"):
            for submit, s in prefix.get(cache, {}).items():
                table.add_row(model, "prefix", f"lmd cache {cache}, {submit}", str(s["requests"]), "-",
                              _f(s["total_s"], 2), "-", "-", _f((s["ttft_ms"] or {}).get("mean")),
                              f"prefix hit {s['prefix_hit_tokens']:,} of {s['prompt_tokens']:,} tokens"
                              + (f", TTFT off/on {speedup:.2f}x" if cache == "on" and (
                                  speedup := prefix.get(f"ttft_mean_off_over_on_{submit}")) else ""))
        if "failed" in prefix or "skipped" in prefix:
            table.add_row(model, "prefix", "lmd", *["-"] * 6, prefix.get("failed") or prefix.get("skipped"))
    traced = [((model, system), s) for model, r in results["models"].items()
              for system, s in r.get("real", {}).items() if system.startswith("lmd")]
    traced += [((model, f"lmd KV {label}"), s) for model, r in results["models"].items()
               for label, s in r.get("kv-int8", {}).items() if label in ("float", "int8")]
    for (model, system), trace in ((mr, s.get("step_trace")) for mr, s in traced):
        if trace and trace.get("steps"):
            parts = [f"{kind} {t['steps']} steps ({t['graph_steps']} graphs) wall {t['wall_s']:.2f} s GPU "
                     f"{t['gpu_s']:.2f} s, median GPU {_f(t['median_gpu_ms'], 2)} ms, launch "
                     f"{_f(t['median_host_launch_ms'], 2)} ms, {t['mean_rows']:.0f} rows"
                     + (f", {t['prefill_tokens']:,} prefill tokens" if kind == "mixed" else "")
                     for kind in ("decode", "mixed") if (t := trace[kind])]
            console.print(f"{model}, {system}: steps: wall {trace['wall_s']:.2f} s, GPU forward "
                          f"{trace['gpu_forward_s']:.2f} s; " + "; ".join(parts)
                          + f"; batch full until {_f(trace.get('last_full_batch_s'), 2)} s, "
                          f"tail (< 64 rows) {trace['tail_below_64_rows']['steps']} steps "
                          f"{trace['tail_below_64_rows']['wall_s']:.2f} s; Triton compiles "
                          f"{trace['triton_compiles']['count']} ({trace['triton_compiles']['host_s']:.2f} s: "
                          f"{', '.join(trace['triton_compiles']['kernels'])})")
    for model, r in results["models"].items():
        for system, s in r.get("real", {}).items():
            if isinstance(s, dict) and s.get("host_profile"):
                console.print(f"{model}, {system}: Python own time per engine step (cProfile, timed run slowed)")
                for row in s["host_profile"]:
                    console.print(f"  {row['own_ms_per_step']:8.3f} ms  {row['calls_per_step']:8.1f} calls  "
                                  f"{row['function'][:100]}")
    console.print(table)  # last


# ---- main ----


def parse_limits(text: str) -> dict[str, float]:
    limits = {}
    for part in filter(None, text.split(",")):
        workload, _, seconds = part.partition("=")
        if workload not in WORKLOADS or not seconds:
            raise SystemExit(f"--limit-s {text}: give WORKLOAD=SECONDS,... with workloads from {', '.join(WORKLOADS)}")
        limits[workload] = float(seconds)
    return limits


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of real, kv-int8, prefix")
    p.add_argument("--lmd-step-lengths", default="", type=lambda v: [int(x) for x in v.split(",") if x],
                   help="comma list: the real workload again on lmd's engine with each admission interval "
                        "(step_length), after the run at the workspace's own")
    p.add_argument("--real-kv-int8", action="store_true",
                   help="the real workload also on an lmd engine with online int8 KV (quant_policy 4)")
    p.add_argument("--models", default="llama3-8b,llama2-7b", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--num-requests", type=int, help="requests of the real workload (default 1000; tiny 12)")
    p.add_argument("--hf-requests", type=int, help="the first N requests also through HF transformers, 0 skips "
                   "(default 64; tiny 8)")
    p.add_argument("--hf-models", help="models HF transformers runs on (default: the first of --models)")
    p.add_argument("--hf-batch-size", type=int, help="HF static batch (default 64; tiny 4)")
    p.add_argument("--kv-requests", type=int,
                   help="requests of the kv-int8 workload, the real lengths cycled (default 2048; tiny 8)")
    p.add_argument("--kv-cache-tokens", type=int, help="kv-int8: tokens the float KV pool holds (default 16384; "
                   "tiny 256); int8 gets the same bytes")
    p.add_argument("--prefix-conversations", type=int, help="MT-bench conversations (default 80; tiny 6)")
    p.add_argument("--prefix-reply-len", type=int, help="tokens of each first-turn reply (default 256; tiny 24)")
    p.add_argument("--prefix-turn2-len", type=int, default=8, help="tokens generated in the second turn")
    p.add_argument("--session-len", type=int, help="default 2048; tiny 256")
    p.add_argument("--max-batch-size", type=int, help="default 256; tiny 8")
    p.add_argument("--prefill-tokens", type=int, help="prefill tokens per step, both engines (default 8192, "
                   "LMDeploy's; tiny 64)")
    p.add_argument("--cache-fraction", type=float, default=0.5, help="KV pool of real/prefix: share of free memory")
    p.add_argument("--block-len", type=int, help="KV block tokens, both engines (default 64; tiny 16)")
    p.add_argument("--max-prompt-len", type=int, help="clip prompts (default 1024; tiny 48)")
    p.add_argument("--max-output-len", type=int, help="clip outputs (default 1024; tiny 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="lmd's tensor-parallel ranks, on GPUs 0..N-1 (with --no-peer: "
                   "LMDeploy's run is one GPU)")
    p.add_argument("--shard", type=parse_shard, metavar="I/N",
                   help="serve requests I, I + N, ... of the real workload only: replica I of N data-parallel ones "
                        "(benchmarks/data_parallel.py runs them; lmd alone, with --no-peer)")
    p.add_argument("--lengths", help="token counts written by --prepare (else counted from --data-dir)")
    p.add_argument("--prepare", metavar="FILE", help="count the lengths (data + tokenizer), write FILE, exit")
    p.add_argument("--data-dir", default=os.environ.get("LMD_DATA_DIR", str(REPO.parent / "shared" / "data")))
    p.add_argument("--tokenizer", default=str(REPO.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"),
                   help="tokenizer that counts the lengths: a .gguf file or a tokenizer directory")
    p.add_argument("--peers", default=".peers", help="folder holding lmdeploy-pt-0.18/ (a copy of ../shared/peers)")
    p.add_argument("--no-peer", action="store_true", help="no LMDeploy")
    p.add_argument("--profile-host", action="store_true",
                   help="cProfile the timed lmd real-length runs (slows them: not for comparisons) and print where "
                        "their Python time goes")
    p.add_argument("--peer-timeout", type=float, default=300, help="seconds the LMDeploy child may take")
    p.add_argument("--budget-s", type=float, default=510,
                   help="no phase starts after this many seconds of the run (a device call ends at 600)")
    p.add_argument("--limit-s", default="", help="per model and workload, e.g. real=240,kv-int8=60,prefix=45")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of serving_workloads.json")
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU, few requests, no peer (script check)")
    p.add_argument("--lmdeploy-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    big = not args.tiny
    defaults = dict(num_requests=1000 if big else 12, hf_requests=64 if big else 8, hf_batch_size=64 if big else 4,
                    kv_requests=2048 if big else 8, kv_cache_tokens=16384 if big else 256,
                    prefix_conversations=80 if big else 6, prefix_reply_len=256 if big else 24,
                    session_len=2048 if big else 256, max_batch_size=256 if big else 8,
                    prefill_tokens=8192 if big else 64, block_len=64 if big else 16,
                    max_prompt_len=MAX_PROMPT if big else 48, max_output_len=1024 if big else 12)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.workloads = args.workloads.split(",")
    args.models = ["tiny"] if args.tiny else args.models.split(",")
    if args.tiny:
        args.no_peer = True
    args.hf_models = args.hf_models.split(",") if args.hf_models else args.models[:1]
    unknown = [w for w in args.workloads if w not in WORKLOADS] + [m for m in args.models
                                                                   if m not in MODELS and m != "tiny"]
    if unknown:
        raise SystemExit(f"unknown workload or model {', '.join(unknown)}; workloads {', '.join(WORKLOADS)}, "
                         f"models {', '.join(MODELS)}")
    args.limits = parse_limits(args.limit_s)
    if args.tp < 1:
        raise SystemExit(f"--tp {args.tp}: at least 1")
    if args.tp > 1 and not args.no_peer:
        raise SystemExit(f"--tp {args.tp} measures lmd alone: add --no-peer (LMDeploy's peer run is one GPU)")
    if args.shard is not None and not args.no_peer:
        raise SystemExit("--shard measures one lmd replica: add --no-peer")
    return args


def parse_shard(text: str) -> tuple[int, int]:
    """"I/N" -> (I, N), 0 <= I < N."""
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: I/N, replica I of N (e.g. 0/2)") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"{text!r}: I/N with 0 <= I < N")
    return index, count


def get_lengths(args: argparse.Namespace) -> Lengths:
    if args.lengths:
        lengths = load_lengths(Path(args.lengths))
    else:
        data = Path(args.data_dir)
        if not (data / "sharegpt").is_dir():
            raise SystemExit(f"no {data}/sharegpt: run `python3 benchmarks/serving_workloads.py --prepare FILE` where "
                             "the data and the tokenizer are, then pass --lengths FILE")
        lengths = count_lengths(data, args.tokenizer, args.num_requests, args.seed)
    if len(lengths.requests) < args.num_requests:
        raise SystemExit(f"{args.lengths} holds {len(lengths.requests)} requests; lower --num-requests "
                         "or --prepare with more")
    return lengths


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.lmdeploy_child:
        lmdeploy_child(args.lmdeploy_child)
        return {}
    if args.prepare:
        lengths = count_lengths(Path(args.data_dir), args.tokenizer, args.num_requests, args.seed)
        save_lengths(lengths, Path(args.prepare))
        print(f"{len(lengths.requests)} requests, {len(lengths.conversations)} conversations -> {args.prepare}")
        return asdict(lengths)
    global PROFILE_HOST
    PROFILE_HOST = args.profile_host
    lengths = get_lengths(args)
    device = "cpu" if args.tiny else "cuda"
    settings = Settings(device, args.session_len, args.max_batch_size, args.prefill_tokens, args.cache_fraction,
                        args.block_len, args.max_prompt_len, args.max_output_len, args.seed, args.tp)
    out = Path(args.out, "serving_workloads.json")
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "out": str(out), "settings": asdict(settings),
        "args": {k: v for k, v in vars(args).items() if k != "lmdeploy_child"},
        "lengths": lengths.source | {"requests": len(lengths.requests), "conversations": len(lengths.conversations)},
        "models": {}}
    phases = Phases(args.budget_s, args.limits, results, out)
    for name in args.models:
        spec = TINY_MODEL if name == "tiny" else MODELS[name]
        run_model(name, spec, lengths, settings, args, phases)
        phases.save()
    print_tables(results)
    return results


if __name__ == "__main__":
    main()
