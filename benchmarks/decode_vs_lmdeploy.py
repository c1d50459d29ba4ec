"""Decode ms per token beside LMDeploy's PyTorch engine and gpt-fast, in one call: the same random Llama-2-7B-shaped
fp16 weights, 128 prompt / 128 output tokens, greedy, EOS ignored, batch 1 / 16 / 64 (issue 14's table).

    python3 benchmarks/decode_vs_lmdeploy.py [--batch-sizes 1,16,64] [--gpt-fast-batch-sizes 1,16] [--peers .peers]
    python3 benchmarks/decode_vs_lmdeploy.py --weights int4 --no-gpt-fast   # lmd int4 beside LMDeploy serving AWQ
    python3 benchmarks/decode_vs_lmdeploy.py --tiny --peers ../shared/peers   # tiny model on CPU: checks the script

lmd runs through `lmd.bench.latency` with deferred output off and on (engine option `async_output`) and CUDA graphs
on; its start-up time (weights + graph capture of every batch bucket) is recorded. LMDeploy 0.18.0 (PyTorch engine,
CUDA graphs, installed from `<peers>/lmdeploy-pt-0.18/wheels` into /tmp/site, see ../shared/peers/README.md) runs in a
child process on an HF checkpoint rebuilt from lmd's workspace (`reconstruct_hf_state_dict`), fed token ids through
its async engine; its decode interval per request is (time of the last token - time of the first) / (tokens - 1),
lmd.bench's definition. gpt-fast (`<peers>/gpt-fast/model.py`, decode step under torch.compile reduce-overhead,
static KV cache) runs in another child, `benchmarks/gpt_fast_peer.py`, on lmd's exact weights, at
`--gpt-fast-batch-sizes` (its compile takes ~2 min for the first batch size and recompiles for each further one;
`--no-gpt-fast` skips it). A peer that fails or times out is reported in the table and the JSON, never fatal.
`--tiny` runs lmd and gpt-fast (eager, no torch.compile) on CPU; LMDeploy is skipped there.
Writes $OUT/decode_vs_lmdeploy.json and prints a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import LLAMA2_7B, TINY, build_workspace, prewarm_int4, write_tokenizer  # noqa: E402
from step_trace import StepTrace  # noqa: E402

from lmd.bench.latency import LatencyConfig, run_latency  # noqa: E402

INPUT_LEN, OUTPUT_LEN = 128, 128
LMDEPLOY_SITE = "/tmp/site"  # where the peer's wheels are installed (../shared/peers/README.md)


def lmd_rows(ws: Path, args: argparse.Namespace, device: str, async_output: bool) -> dict:
    from lmd.turbomind.engine import Engine

    dtype = "fp16" if device == "cuda" else "fp32"
    start = time.perf_counter()
    with Engine(ws, device=device, dtype=dtype, max_batch_size=max(args.batch_sizes), session_len=1024,
                async_output=async_output) as engine:
        start_s = time.perf_counter() - start
        graphs = engine.runner.graphs
        config = LatencyConfig(INPUT_LEN, OUTPUT_LEN, tuple(args.batch_sizes), args.warmup, args.iters, args.seed)
        rows = {}
        for result in run_latency(engine, config):
            decode = result.decode_per_token()
            rows[result.batch_size] = {"decode_ms_mean": decode.mean * 1e3, "decode_ms_median": decode.median * 1e3}
        if args.trace and async_output:  # one more batch per size under the step trace: where the GPU waits
            for b in args.batch_sizes:
                with StepTrace(engine) as trace:
                    run_latency(engine, LatencyConfig(INPUT_LEN, OUTPUT_LEN, (b,), 0, 1, args.seed + 1000))
                rows[b]["trace"] = summary = trace.summary()
                d = summary.get("decode", {})
                print(f"  trace batch {b}: decode steps {d.get('steps')}, forward {d.get('median_gpu_ms')} ms, "
                      f"before sampling {d.get('median_before_sample_ms')}, sampling {d.get('median_sample_ms')}, "
                      f"after sampling (GPU waits for the host) {d.get('median_after_sample_ms')} ms (medians); "
                      f"host launch {d.get('median_host_launch_ms')} ms", flush=True)
    return {"engine_start_s": start_s, "graph_buckets": None if graphs is None else list(graphs.buckets),
            "rows": rows}


def write_hf_checkpoint(ws: Path, out: Path, shape: dict, session_len: int = 1024, dtype: str = "float16") -> Path:
    """lmd's workspace back as an HF Llama directory (the same weights), for the peers; `dtype` is config.json's."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from lmd.deploy.workspace_reader import reconstruct_hf_state_dict

    out.mkdir(parents=True)
    state = {name: t.contiguous() for name, t in reconstruct_hf_state_dict(ws).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state
    LlamaConfig(**shape, max_position_embeddings=session_len, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                dtype=dtype, architectures=["LlamaForCausalLM"]).save_pretrained(str(out))
    write_tokenizer(out, shape["vocab_size"])
    return out


def write_awq_checkpoint(ws: Path, out: Path, shape: dict, session_len: int = 1024) -> Path:
    """lmd's int4 workspace back as an AutoAWQ gemm checkpoint with the same codes, scales and zeros
    (`w4a16_layout.engine_to_awq`), for LMDeploy's AWQ path: fp16 norms, embedding and lm_head; q/k/v and gate/up
    split out of the fused linears along their outputs."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from lmd.deploy.workspace_reader import load_rank_tensors, read_workspace_config
    from lmd.turbomind.kernels.w4a16_layout import engine_to_awq
    from lmd.workspace_format.rank_layout import merge_ranks

    cfg = read_workspace_config(ws)
    whole = merge_ranks([load_rank_tensors(ws, r) for r in range(cfg.tensor_para_size)], cfg.rank_shape)
    vocab, d = cfg.vocab_size, cfg.size_per_head
    state = {"model.embed_tokens.weight": whole["tok_embeddings.weight"][:vocab],
             "model.norm.weight": whole["norm.weight"], "lm_head.weight": whole["output.weight"][:vocab]}

    def put(name: str, prefix: str, cols: slice) -> None:
        qweight, scales, zeros = (whole[f"{prefix}.{t}"][:, cols] for t in ("qweight", "scales", "zeros"))
        state[f"{name}.qweight"], state[f"{name}.qzeros"], state[f"{name}.scales"] = engine_to_awq(
            qweight.contiguous(), scales.contiguous(), zeros.contiguous())

    q, kv, inter = cfg.head_num * d, cfg.kv_head_num * d, shape["intermediate_size"]
    for i in range(cfg.num_layer):
        src, hf = f"layers.{i}.", f"model.layers.{i}."
        state[f"{hf}input_layernorm.weight"] = whole[f"{src}attention_norm.weight"]
        state[f"{hf}post_attention_layernorm.weight"] = whole[f"{src}ffn_norm.weight"]
        for name, cols in (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)), ("v_proj", slice(q + kv, q + 2 * kv))):
            put(f"{hf}self_attn.{name}", f"{src}attention.w_qkv", cols)
        put(f"{hf}self_attn.o_proj", f"{src}attention.wo", slice(None))
        put(f"{hf}mlp.gate_proj", f"{src}feed_forward.w13", slice(0, inter))
        put(f"{hf}mlp.up_proj", f"{src}feed_forward.w13", slice(inter, 2 * inter))
        put(f"{hf}mlp.down_proj", f"{src}feed_forward.w2", slice(None))
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    LlamaConfig(**shape, max_position_embeddings=session_len, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                dtype="float16", architectures=["LlamaForCausalLM"],
                quantization_config={"quant_method": "awq", "bits": 4, "group_size": cfg.group_size,
                                     "zero_point": True, "version": "gemm"}).save_pretrained(str(out))
    write_tokenizer(out, shape["vocab_size"])
    return out


def lmdeploy_child(hf_dir: str, batch_sizes: list[int], warmup: int, iters: int, seed: int) -> dict:
    """Runs in the child process (LMDeploy installed on its path)."""
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline

    start = time.perf_counter()
    pipe = pipeline(hf_dir, backend_config=PytorchEngineConfig(tp=1, max_batch_size=max(batch_sizes),
                                                               cache_max_entry_count=0.5, session_len=1024))
    start_s = time.perf_counter() - start
    gen = GenerationConfig(max_new_tokens=OUTPUT_LEN, ignore_eos=True, do_sample=False)
    g = torch.Generator().manual_seed(seed)
    session = iter(range(1, 10**9))

    async def one(ids: list[int]) -> float | None:
        first = last = None
        async for out in pipe.generate(messages=None, session_id=next(session), gen_config=gen, input_ids=ids,
                                       stream_response=True, do_preprocess=False):
            now, count = time.perf_counter(), out.generate_token_len
            if count and first is None:
                first = (now, count)
            last = (now, count)
        if first is None or last[1] <= first[1]:
            return None
        return (last[0] - first[0]) / (last[1] - first[1])

    async def batch(b: int) -> list[float]:
        prompts = [torch.randint(3, 32000, (INPUT_LEN,), generator=g).tolist() for _ in range(b)]
        return [x for x in await asyncio.gather(*(one(p) for p in prompts)) if x is not None]

    rows = {}
    for b in batch_sizes:
        gaps: list[float] = []
        for i in range(warmup + iters):
            out = pipe._run(coro=batch(b)).result()
            if i >= warmup:
                gaps += out
        rows[b] = {"decode_ms_mean": statistics.mean(gaps) * 1e3, "decode_ms_median": statistics.median(gaps) * 1e3}
    pipe.close()
    return {"engine_start_s": start_s, "rows": rows}


def install_lmdeploy(peers: str | os.PathLike[str]) -> dict | None:
    """LMDeploy 0.18's wheels from `<peers>/lmdeploy-pt-0.18/wheels` into LMDEPLOY_SITE, once per machine: None when
    it is there, else the peer's row saying why not. Children run it with `lmdeploy_env()`."""
    wheels = sorted(Path(peers, "lmdeploy-pt-0.18", "wheels").glob("*.whl"))
    if not wheels:
        return {"skipped": f"no LMDeploy wheels under {peers}/lmdeploy-pt-0.18/wheels"}
    if Path(LMDEPLOY_SITE, "lmdeploy").is_dir():
        return None
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--no-cache-dir", "--upgrade", "--target", LMDEPLOY_SITE, *map(str, wheels)])
    if pip.returncode != 0:
        return {"failed": f"pip install of the LMDeploy wheels: exit code {pip.returncode}"}
    return None


def lmdeploy_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": LMDEPLOY_SITE + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_lmdeploy(hf_dir: Path, args: argparse.Namespace) -> dict:
    not_ready = install_lmdeploy(args.peers)
    if not_ready is not None:
        return not_ready
    out = Path(tempfile.mkdtemp()) / "lmdeploy.json"
    cmd = [sys.executable, __file__, "--lmdeploy-child", str(hf_dir), "--child-out", str(out),
           "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--warmup", str(args.warmup),
           "--iters", str(args.iters), "--seed", str(args.seed)]
    return run_child(cmd, out, args.peer_timeout, lmdeploy_env())


def run_child(cmd: list[str], out: Path, timeout: float, env: dict | None = None) -> dict:
    """A peer's child process: its result JSON, or what went wrong (with any rows it wrote before); never raises."""
    start = time.perf_counter()
    failed = None
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # its own group: a timeout ends its workers too
        try:
            code = proc.wait(timeout=timeout)
            failed = None if code == 0 else f"exit code {code}"
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            failed = f"timed out after {timeout} s"
    except OSError as exc:
        failed = f"cannot start: {exc}"
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = {}
    if "rows" in result:
        result["rows"] = {int(b): row for b, row in result["rows"].items()}
    if failed:
        result["failed"] = failed
    result["child_wall_s"] = time.perf_counter() - start
    return result


def run_gpt_fast(ws: Path, args: argparse.Namespace, shape: dict, device: str) -> dict:
    folder = Path(args.peers, "gpt-fast")
    if not (folder / "model.py").is_file():
        return {"skipped": f"no gpt-fast under {folder} (model.py)"}
    out = Path(tempfile.mkdtemp()) / "gpt_fast.json"
    cmd = [sys.executable, str(Path(__file__).with_name("gpt_fast_peer.py")), "--gpt-fast-dir", str(folder),
           "--workspace", str(ws), "--shape", json.dumps(shape), "--out", str(out), "--device", device,
           "--batch-sizes", ",".join(map(str, args.gpt_fast_batch_sizes)), "--warmup", str(args.warmup),
           "--iters", str(args.iters), "--seed", str(args.seed)]
    return run_child(cmd + (["--no-compile"] if device == "cpu" else []), out, args.gpt_fast_timeout)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--weights", default="fp16", choices=("fp16", "int4"),
                   help="int4: an AWQ g128 workspace for lmd, its AutoAWQ checkpoint for LMDeploy (gpt-fast skipped)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", default=".peers", help="folder holding lmdeploy-pt-0.18/ (a copy of ../shared/peers)")
    p.add_argument("--no-peer", action="store_true", help="lmd only")
    p.add_argument("--peer-timeout", type=int, default=300, help="seconds the LMDeploy child may take")
    p.add_argument("--no-gpt-fast", action="store_true", help="skip gpt-fast")
    p.add_argument("--gpt-fast-batch-sizes", default="1,16", help="gpt-fast's batch sizes (each one compiles)")
    p.add_argument("--gpt-fast-timeout", type=int, default=330,
                   help="seconds the gpt-fast child may take (weights ~30 s + ~2 min of compile per batch size)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny model on CPU: lmd, and gpt-fast eager from <peers>/gpt-fast (script check)")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="an experiment: the interpreter's GIL switch interval for the lmd runs (Python's default 5)")
    p.add_argument("--trace", action="store_true",
                   help="after the timed runs, one batch per size under benchmarks/step_trace.py (lmd default "
                        "engine): forward, sampling and the GPU's wait for the host per decode step")
    p.add_argument("--lmdeploy-child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.gpt_fast_batch_sizes = [int(b) for b in args.gpt_fast_batch_sizes.split(",")]
    if args.tiny:
        args.batch_sizes, args.gpt_fast_batch_sizes, args.iters, args.no_peer = [1, 4], [1, 4], 1, True
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.lmdeploy_child:
        result = lmdeploy_child(args.lmdeploy_child, args.batch_sizes, args.warmup, args.iters, args.seed)
        Path(args.child_out).write_text(json.dumps(result))
        return
    device = "cpu" if args.tiny else "cuda"
    shape = TINY if args.tiny else LLAMA2_7B
    results: dict = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "iters": args.iters}
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
        results["switch_interval_ms"] = args.switch_interval_ms
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        int4 = args.weights == "int4"
        ws = build_workspace(Path(tmp, "ws"), shape, int4, 1024, torch.device(device))
        if int4 and device == "cuda":
            prewarm_int4(ws, max(args.batch_sizes), torch.device(device))  # timing never includes W4A16 tuning
        results["weights"] = args.weights
        for async_output in (False, True):
            label = f"lmd async_output {'on' if async_output else 'off'}"
            print(f"[{label}]", flush=True)
            results[label] = lmd_rows(ws, args, device, async_output)
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        if not args.no_peer:
            print("[LMDeploy 0.18 PyTorch engine]", flush=True)
            hf_dir = (write_awq_checkpoint if int4 else write_hf_checkpoint)(ws, Path(tmp, "hf"), shape)
            results["LMDeploy 0.18 PT"] = run_lmdeploy(hf_dir, args)
        if not args.no_gpt_fast and not int4:
            print("[gpt-fast]", flush=True)
            results["gpt-fast"] = run_gpt_fast(ws, args, shape, device)
    out = Path(os.environ.get("OUT", "."), "decode_vs_lmdeploy.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print_table(results, sorted(set(args.batch_sizes) | set(args.gpt_fast_batch_sizes)))


def print_table(results: dict, batch_sizes: list[int]) -> None:
    """Decode ms/token per system and batch size, "—" where a system did not run it; notes on peers below."""
    systems = [k for k, v in results.items() if isinstance(v, dict)]

    def cell(value: float | None, fmt: str) -> str:
        return f"{'—' if value is None else format(value, fmt):>26}"

    print(f"\n{results['gpu']}: decode ms/token (mean over requests), {INPUT_LEN} in / {OUTPUT_LEN} out, "
          f"{results.get('weights', 'fp16')} weights")
    print(f"{'batch':>6}" + "".join(f"{s:>26}" for s in systems))
    for b in batch_sizes:
        print(f"{b:>6}" + "".join(cell(results[s].get("rows", {}).get(b, {}).get("decode_ms_mean"), ".2f")
                                  for s in systems))
    print(f"{'start s':>6}" + "".join(cell(results[s].get("engine_start_s"), ".1f") for s in systems))
    for s in systems:
        v = results[s]
        notes = {k: v[k] for k in ("skipped", "failed") if k in v}
        warmups = {b: round(row["warmup_s"], 1) for b, row in v.get("rows", {}).items() if "warmup_s" in row}
        if warmups:
            notes["warm-up (compile) s per batch"] = warmups
        if notes:
            print(f"{s}: {notes}")


if __name__ == "__main__":
    main()
