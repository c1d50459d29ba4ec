"""gpt-fast as a peer of benchmarks/decode_vs_lmdeploy.py: its decode ms/token on lmd's own weights, in a child process.

    python3 benchmarks/gpt_fast_peer.py --gpt-fast-dir .peers/gpt-fast --workspace WS --shape JSON --out FILE
        [--batch-sizes 1,16] [--device cuda] [--no-compile]

The model is gpt-fast's own (`model.py` of pytorch-labs/gpt-fast at 32971d3, imported at run time from
`<peers>/gpt-fast/`, never copied here): `Transformer(ModelArgs(...))` with lmd's shape (for the Llama-2-7B shape the
ModelArgs equal `ModelArgs.from_name("7B")`, recorded as `from_name_7B`). Weights: **lmd's exact weights** — the
workspace turned back into HF-named tensors (`reconstruct_hf_state_dict`, as for the LMDeploy child) and renamed the
way gpt-fast's `scripts/convert_hf_checkpoint.py` does it (q/k rows permuted from HF's rotate-half order to gpt-fast's
interleaved RoPE pairs, q/k/v fused into `wqkv`), fp16 on cuda (fp32 on cpu).

Per batch size: static KV cache (`setup_caches(B, 256)`), eager prefill of B random 128-token prompts, then 127 decode
steps through gpt-fast's decode step under `torch.compile(mode="reduce-overhead", fullgraph=True)` (CUDA graphs) with
SDPA's math backend (`torch.nn.attention.sdpa_kernel`, what generate.py's removed `torch.backends.cuda.sdp_kernel`
call selected), greedy. generate.py itself is not imported (it needs gpt-fast's tokenizer.py and samples
stochastically), so its 4-line `decode_one_token` is restated here with argmax in place of `sample`; its inductor
settings (coordinate descent tuning, FX graph cache) are set as generate.py sets them. Each batch size is compiled
afresh (`dynamic=False`: one static graph per batch size, as gpt-fast runs one batch size per process): the first
compile takes about 2 minutes on the H200 and every further batch size recompiles (budget ~1.5-2 min each). One
warm-up generation per batch size (it holds the compile, recorded as `warmup_s`), then `--iters` timed ones.
Decode ms/token = (time of the last token - time of the first) / (tokens - 1), with `torch.cuda.synchronize()` at
the first token (end of prefill) and after the last: lmd.bench's definition. The result JSON is rewritten after every
batch size, so a child killed by the parent's timeout still leaves the batch sizes it finished.
`--no-compile` (the CPU check, `--tiny`): the same steps eager.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

INPUT_LEN, OUTPUT_LEN = 128, 128


def import_gpt_fast(folder: str | Path):
    """gpt-fast's model.py from the peers folder, as the module `gpt_fast_model` (no sys.path entry, no clash)."""
    import importlib.util

    if "gpt_fast_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpt_fast_model", Path(folder, "model.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpt_fast_model"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpt_fast_model"]


def model_args(gf, shape: dict):
    return gf.ModelArgs(vocab_size=shape["vocab_size"], n_layer=shape["num_hidden_layers"],
                        n_head=shape["num_attention_heads"], n_local_heads=shape["num_key_value_heads"],
                        dim=shape["hidden_size"], intermediate_size=shape["intermediate_size"])


def gpt_fast_state_dict(hf: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """HF Llama tensor names -> gpt-fast's (scripts/convert_hf_checkpoint.py's mapping); consumes `hf`."""
    head_dim = config.dim // config.n_head

    def permute(w: torch.Tensor, heads: int) -> torch.Tensor:  # HF rotate-half rows -> interleaved (re, im) pairs
        return w.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(heads * head_dim, -1)

    out = {"tok_embeddings.weight": hf.pop("model.embed_tokens.weight"), "norm.weight": hf.pop("model.norm.weight")}
    out["output.weight"] = hf.pop("lm_head.weight", out["tok_embeddings.weight"])
    for i in range(config.n_layer):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        q, k, v = (hf.pop(f"{src}self_attn.{x}_proj.weight") for x in "qkv")
        out[f"{dst}attention.wqkv.weight"] = torch.cat([permute(q, config.n_head), permute(k, config.n_local_heads), v])
        out[f"{dst}attention.wo.weight"] = hf.pop(f"{src}self_attn.o_proj.weight")
        for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            out[f"{dst}feed_forward.{mine}.weight"] = hf.pop(f"{src}mlp.{theirs}.weight")
        out[f"{dst}attention_norm.weight"] = hf.pop(f"{src}input_layernorm.weight")
        out[f"{dst}ffn_norm.weight"] = hf.pop(f"{src}post_attention_layernorm.weight")
    return out


def load_model(gf, workspace: str | Path, shape: dict, device: str, dtype: torch.dtype):
    """gpt-fast's Transformer holding lmd's workspace weights (built on meta, then assigned, as gpt-fast loads)."""
    from lmd.deploy.workspace_reader import reconstruct_hf_state_dict

    config = model_args(gf, shape)
    with torch.device("meta"):
        model = gf.Transformer(config)
    state = gpt_fast_state_dict(reconstruct_hf_state_dict(workspace), config)
    model.load_state_dict(state, assign=True)
    del state
    return model.to(device=device, dtype=dtype).eval()


def decode_one_token(model, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """generate.py's decode_one_token, greedy: logits of the one new position -> next ids [B, 1]."""
    logits = model(x, input_pos)
    return torch.argmax(logits[:, -1], dim=-1, keepdim=True).to(torch.int)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def generate(model, decode, prompts: torch.Tensor, output_len: int, device: str) -> tuple[float, torch.Tensor]:
    """One batch: eager prefill, output_len - 1 decode steps; (seconds per decode token, ids [B, output_len])."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    prompt_len = prompts.shape[1]
    token = decode_one_token(model, prompts, torch.arange(0, prompt_len, device=device))  # prefill: first token
    sync(device)
    first = time.perf_counter()
    input_pos = torch.tensor([prompt_len], device=device, dtype=torch.int)
    tokens = [token]
    with sdpa_kernel([SDPBackend.MATH]):
        for _ in range(output_len - 1):
            token = decode(model, token, input_pos).clone()  # a CUDA-graph output is overwritten by the next replay
            input_pos += 1
            tokens.append(token)
    sync(device)
    return (time.perf_counter() - first) / (output_len - 1), torch.cat(tokens, dim=1)


def run(args: argparse.Namespace) -> dict:
    gf = import_gpt_fast(args.gpt_fast_dir)
    shape = json.loads(args.shape)
    device, compiled = args.device, not args.no_compile
    dtype = torch.float16 if device == "cuda" else torch.float32
    if compiled:  # what generate.py sets at import
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config

        inductor_config.coordinate_descent_tuning = True
        inductor_config.triton.unique_kernel_names = True
        inductor_config.fx_graph_cache = True
        functorch_config.enable_autograd_cache = True
    start = time.perf_counter()
    model = load_model(gf, args.workspace, shape, device, dtype)
    sync(device)
    config = model.config
    result = {"engine_start_s": time.perf_counter() - start, "compiled": compiled, "dtype": str(dtype),
              "weights": "lmd's workspace (reconstruct_hf_state_dict, convert_hf_checkpoint's mapping)",
              "model_args": {k: v for k, v in vars(config).items() if k != "rope_scaling"},
              "from_name_7B": config == gf.ModelArgs.from_name("7B"), "max_seq_length": INPUT_LEN + OUTPUT_LEN,
              "torch": torch.__version__, "rows": {}}
    g = torch.Generator().manual_seed(args.seed)
    for b in args.batch_sizes:
        model.max_seq_length = -1  # setup_caches keeps larger caches; each batch size gets its own, exactly B
        with torch.device(device):
            model.setup_caches(max_batch_size=b, max_seq_length=INPUT_LEN + OUTPUT_LEN)
        decode = decode_one_token
        if compiled:
            torch._dynamo.reset()
            decode = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True, dynamic=False)
        prompts = torch.randint(3, shape["vocab_size"], (b, INPUT_LEN), generator=g, dtype=torch.int).to(device)
        t0 = time.perf_counter()
        for _ in range(max(args.warmup, 1 if compiled else 0)):
            generate(model, decode, prompts, OUTPUT_LEN, device)
        warmup_s = time.perf_counter() - t0
        gaps = []
        for _ in range(args.iters):
            gap, ids = generate(model, decode, prompts, OUTPUT_LEN, device)
            gaps.append(gap)
        assert ids.shape == (b, OUTPUT_LEN), ids.shape
        result["rows"][b] = {"decode_ms_mean": statistics.mean(gaps) * 1e3,
                             "decode_ms_median": statistics.median(gaps) * 1e3, "warmup_s": warmup_s,
                             "first_ids": ids[0, :8].tolist()}
        print(f"gpt-fast batch {b}: {result['rows'][b]['decode_ms_mean']:.2f} ms/token (warm-up {warmup_s:.1f} s)",
              flush=True)
        write(args.out, result)
    return result


def write(path: str | Path, result: dict) -> None:
    tmp = Path(f"{path}.part")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, what in (("--gpt-fast-dir", "the folder holding gpt-fast's model.py"),
                       ("--workspace", "lmd workspace whose weights gpt-fast runs"),
                       ("--shape", "JSON: transformers LlamaConfig keywords (benchmarks/engine.py)"),
                       ("--out", "result JSON, rewritten after every batch size")):
        p.add_argument(flag, required=True, help=what)
    for flag, default in (("--warmup", 1), ("--iters", 3), ("--seed", 0)):  # warm-ups: >= 1 when compiled
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-compile", action="store_true", help="eager decode steps (the CPU check)")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    return args


if __name__ == "__main__":
    run(parse_args())
