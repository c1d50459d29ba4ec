"""Full-shape GPU check and timing of the Triton paged-attention kernels against the PyTorch reference.

    python3 benchmarks/gpu_attention_tests.py [--quick] [--no-sweep | --sweep-only]

For Llama-2-7B heads (32 x 128), GQA 32/8 x 128 and SmolLM2's 9/3 x 64, fp16 and bf16, KV in the compute dtype or
int8 (static per head, static per channel, online per token), block sizes 64 and 16, on batches of long-context
decodes, mixed prefill + decode, and prefill only (shuffled block ids; contexts not multiples of the block):
  - the kernel's max abs error against the reference's explicit fp32-softmax path (fused=False); it passes when it
    is below the dtype's tolerance or within 2x of the engine's current path (SDPA per sequence, fused=True);
  - the time of one layer's attention: kernel vs that current path (CUDA events, median of 20 calls);
  - RoPE, the KV write and batch-64 MHA decode attention in one launch, fp16 and bf16, against the same three steps
    on the reference (output and the written K/V pools);
  - unless --no-sweep, a few block-shape/warp/stage configs on three cases (the fastest is the next default).
Writes $OUT/gpu_attention_tests.json when OUT is set; prints a short table last; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmd.turbomind.forward_batch import ForwardBatch  # noqa: E402
from lmd.turbomind.kernels.paged_attention import AttentionConfig  # noqa: E402
from lmd.turbomind.kv_cache import KVCache  # noqa: E402
from lmd.turbomind.kv_int8 import StaticKVParams  # noqa: E402
from lmd.turbomind.paged_attention import paged_attention_reference, paged_attention_triton_on_cache  # noqa: E402

MODELS = {"llama2-7b": (32, 32, 128), "gqa-32/8": (32, 8, 128), "smollm2": (9, 3, 64)}  # q heads, kv heads, dim
TOL = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
KV_MODES = ("float", "int8-static-head", "int8-static-channel", "int8-online")
DEVICE = "cuda"


@dataclass(frozen=True)
class Shape:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (new tokens, tokens cached before them) per sequence


SHAPES = (
    Shape("decode 32x~4k", tuple((1, 4095 - 61 * i) for i in range(32))),
    Shape("decode 1x16k", ((1, 16383),)),
    Shape("decode 128x~1k", tuple((1, 1000 + 3 * i) for i in range(128))),
    Shape("prefill 2k + 31 decodes", ((2048, 0),) + tuple((1, 2000 + 7 * i) for i in range(31))),
    Shape("chunk 512@1536 + 15 dec", ((512, 1536),) + tuple((1, 3000 + 11 * i) for i in range(15))),
    Shape("prefill 4x1k", tuple((1024 - 5 * i, 0) for i in range(4))),
    Shape("decode 64x~150", tuple((1, 128 + 2 * i) for i in range(64))),  # the engine's batch-64 decode (issue 14)
)
NARROW_SHAPES = (Shape("decode 1x200", ((1, 199),)), Shape("decode 1x4k (split)", ((1, 4000),)),
                 Shape("decode 8x~150", tuple((1, 130 + 9 * i) for i in range(8))))


def build(
    shape: Shape, model: str, dtype: torch.dtype, kv: str, block: int, gen: torch.Generator
) -> tuple[KVCache, ForwardBatch, torch.Tensor]:
    """A one-layer cache holding every sequence (written through KVCache.write, as the engine does), the batch of the
    sequences' new tokens, and their queries. `gen` draws the block ids (CPU); the values come from the device."""
    hq, hkv, d = MODELS[model]
    dev = torch.device(DEVICE)
    need = [-(-(n + start) // block) for n, start in shape.seqs]
    num_blocks = sum(need) + 8
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, prefix, chunks = [], [], []
    for (n, start), count in zip(shape.seqs, need, strict=True):
        table, ids = ids[:count], ids[count:]
        tables.append(table)
        prefix.append(([0] * (start + n), 0, table))
        chunks.append(([0] * n, start, table))
    slots = ForwardBatch.build(prefix, block, [], dev).slots
    total = slots.shape[0]
    k = torch.randn(total, hkv, d, device=dev, dtype=dtype) * 2
    v = torch.randn(total, hkv, d, device=dev, dtype=dtype)
    static = None
    if kv.startswith("int8-static"):
        dims = (0, 2) if kv == "int8-static-head" else 0
        params = []
        for x in (k, v):
            hi, lo = x.float().amax(dim=dims), x.float().amin(dim=dims)
            params += [((hi - lo) / 255).reshape(hkv, -1), ((hi + lo) / 2).reshape(hkv, -1)]
        static = StaticKVParams(*((p,) for p in params))
    cache = KVCache(1, num_blocks, block, hkv, d, dtype, dev, int8=kv != "float", static_params=static)
    cache.write(0, k, v, slots)
    del k, v
    batch = ForwardBatch.build(chunks, block, [], dev)
    q = torch.randn(batch.num_tokens, hq, d, device=dev, dtype=dtype)
    return cache, batch, q


def time_ms(fn, reps: int = 20) -> float:
    """Median of single calls, host overhead included (the engine launches these without CUDA graphs)."""
    fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in pairs)[reps // 2]


def kv_bytes(cache: KVCache, batch: ForwardBatch) -> int:
    """Bytes of K and V (and online params) a perfect kernel reads once per KV head."""
    _, _, hkv, d = cache.k[0].shape
    per_token = 2 * hkv * (d * cache.k[0].element_size() + (4 if cache.k_param else 0))
    return sum(batch.ctx_lens) * per_token


def check(shape: Shape, model: str, dtype: torch.dtype, kv: str, block: int, gen: torch.Generator) -> dict:
    cache, batch, q = build(shape, model, dtype, kv, block, gen)
    scale = q.shape[-1] ** -0.5
    exact = paged_attention_reference(q, cache, 0, batch, scale, fused=False).float()
    out = paged_attention_triton_on_cache(q, cache, 0, batch, scale)
    sdpa = paged_attention_reference(q, cache, 0, batch, scale, fused=True)
    err = (out.float() - exact).abs().max().item() if torch.isfinite(out).all() else float("inf")
    sdpa_err = (sdpa.float() - exact).abs().max().item()
    ok = err <= max(TOL[dtype], 2 * sdpa_err)
    t_kernel = time_ms(lambda: paged_attention_triton_on_cache(q, cache, 0, batch, scale))
    t_ref = time_ms(lambda: paged_attention_reference(q, cache, 0, batch, scale, fused=True), reps=5)
    row = dict(shape=shape.name, model=model, dtype=str(dtype).removeprefix("torch."), kv=kv, block=block, ok=ok)
    gbps = kv_bytes(cache, batch) / t_kernel / 1e6
    row.update(max_err=err, sdpa_err=sdpa_err, kernel_ms=t_kernel, reference_ms=t_ref, kernel_gbps=gbps)
    status = "ok  " if ok else "FAIL"
    print(
        f"{status} {shape.name:24s} {model:9s} {row['dtype']:8s} {kv:19s} bs{block:<3d} err {err:.1e} "
        f"(sdpa {sdpa_err:.1e})  {t_kernel:7.3f} ms vs {t_ref:8.3f} ms  {row['kernel_gbps']:6.0f} GB/s",
        flush=True,
    )
    return row


def _relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| / max(|b|, 1) over elements that differ (slots never written hold the same bits in both
    pools). Not |b| alone: where the rotation's two products cancel, the reference's two roundings leave an error
    of the products' size, not the result's."""
    same = (a == b) | (a.isnan() & b.isnan())
    rel = (a.float() - b.float()).abs() / b.float().abs().clamp_min(1.0)
    return torch.where(same, 0.0, rel).max().item()


def check_rope_decode(dtype: torch.dtype, gen: torch.Generator, kv: str = "float", shape: Shape | None = None,
                      config: AttentionConfig | None = None) -> dict:
    """RoPE + KV write + decode attention in one launch (`rope_decode_attention`, Llama-2-7B heads, batch 64 or
    `shape` with `config`) against rotating, writing and attending with the reference; the written K/V compared too
    (float: the pools' bits; int8: the values read back, within one code step of the reference's)."""
    from lmd.turbomind.kernels.paged_attention import attention_meta
    from lmd.turbomind.kernels.paged_decode import rope_decode_attention
    from lmd.turbomind.kernels.rotary import rotary_qkv_triton
    from lmd.turbomind.paged_attention import _int8_params
    from lmd.turbomind.rope import rotary_qkv_reference

    shape = shape or SHAPES[6]
    cache, batch, _ = build(shape, "llama2-7b", dtype, kv, 64, gen)
    ref_cache = copy.deepcopy(cache)
    hq, _, d = MODELS["llama2-7b"]
    rotary_pools = [cache.k[0].clone(), cache.v[0].clone()]
    t = batch.num_tokens
    qkv = torch.randn(t, 3 * hq * d, device=DEVICE, dtype=dtype)
    angles = torch.rand(t, d // 2, device=DEVICE) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    scale = d**-0.5
    q, k, v = rotary_qkv_reference(qkv, cos, sin, hq, hq, d)
    ref_cache.write(0, k, v, batch.slots)
    exact = paged_attention_reference(q, ref_cache, 0, batch, scale, fused=False).float()
    sdpa = paged_attention_reference(q, ref_cache, 0, batch, scale, fused=True).float()
    sdpa_err = (sdpa - exact).abs().max().item()
    meta = attention_meta(batch.q_starts, batch.q_lens, batch.ctx_lens, batch.block_tables, qkv.device)
    out = rope_decode_attention(qkv, cos, sin, batch.slots, cache.k[0], cache.v[0], meta, scale, hq, config,
                                **_int8_params(cache, 0))
    row = dict(shape=f"{shape.name} rope+write", model="llama2-7b", dtype=str(dtype).removeprefix("torch."),
               kv=kv, block=64, ok=False, max_err=float("inf"), sdpa_err=sdpa_err, kernel_ms=float("nan"),
               reference_ms=float("nan"), kernel_gbps=float("nan"))
    if out is not None and kv == "float":
        err = (out.float() - exact).abs().max().item()
        pools = (cache.k[0], cache.v[0])
        # the stored keys: one rounding of the rotation against the reference's two, a unit in the last place
        pool_err = max(_relative_diff(a, b) for a, b in zip(pools, (ref_cache.k[0], ref_cache.v[0]), strict=True))
        ok = err <= max(TOL[dtype], 2 * sdpa_err) and pool_err <= 2 * torch.finfo(dtype).eps
        # informational: the rotation's FMA contraction may differ between the two kernels by one rounding
        flat = [p.view(-1, hq, d) for p in rotary_pools]
        rotary_qkv_triton(qkv, cos, sin, hq, hq, d, *flat, batch.slots)  # what the two-launch path stores
        same = all(torch.equal(a, b) for a, b in zip(pools, rotary_pools, strict=True))
        row.update(max_err=err, pool_err=pool_err, ok=ok, same_bits_as_rotary_kernel=same)
    elif out is not None:
        err = (out.float() - exact).abs().max().item()
        # int8: a code one step off where the rotation's last-place difference crosses a rounding boundary
        steps, pool_err = 0.0, 0.0
        for table, ctx in zip(batch.block_tables, batch.ctx_lens, strict=True):
            for a, b in zip(cache.read(0, table, ctx), ref_cache.read(0, table, ctx), strict=True):
                pool_err = max(pool_err, (a.float() - b.float()).abs().max().item())
            if kv == "int8-online":  # the written tokens' steps (the rest of the pool is uninitialised)
                steps = max(steps, *(p[0][table].flatten(0, 1)[:ctx, :, 0].float().max().item()
                                     for p in (ref_cache.k_param, ref_cache.v_param)))
        if kv != "int8-online":
            s = ref_cache.static
            steps = max(s.k_scale[0].max().item(), s.v_scale[0].max().item())
        ok = err <= max(TOL[dtype], 2 * sdpa_err) + steps / 4 and pool_err <= 1.01 * steps + TOL[dtype]
        row.update(max_err=err, pool_err=pool_err, ok=ok, code_step=steps)
    status = "ok  " if row["ok"] else "FAIL"
    print(f"{status} {row['shape']:24s} llama2-7b {row['dtype']:8s} {kv:19s} one launch: err {row['max_err']:.1e} "
          f"(sdpa {sdpa_err:.1e}), K/V {row.get('pool_err', float('nan')):.1e}, the rotary kernel's bits "
          f"{row.get('same_bits_as_rotary_kernel')}", flush=True)
    return row


def sweep(shape: Shape, model: str, configs: list[AttentionConfig], gen: torch.Generator) -> list[dict]:
    cache, batch, q = build(shape, model, torch.float16, "float", 64, gen)
    scale = q.shape[-1] ** -0.5
    exact = paged_attention_reference(q, cache, 0, batch, scale, fused=False).float()
    rows = []
    for cfg in configs:
        try:
            out = paged_attention_triton_on_cache(q, cache, 0, batch, scale, cfg)
            err = (out.float() - exact).abs().max().item()
            ms = time_ms(lambda c=cfg: paged_attention_triton_on_cache(q, cache, 0, batch, scale, c))
        except Exception as e:  # a config the compiler rejects (shared memory, registers) is reported, not fatal
            rows.append(dict(shape=shape.name, model=model, config=asdict(cfg), error=str(e)[:200]))
            continue
        rows.append(
            dict(shape=shape.name, model=model, config=asdict(cfg), ms=ms, max_err=err, ok=err <= TOL[torch.float16])
        )
    print(f"swept {shape.name} {model}: {len(rows)} configs", flush=True)
    return rows


def print_sweep_summary(sweeps: list[dict]) -> None:
    """Per swept case: the default config's time and the fastest correct config (the first row is the default)."""
    cases: dict[tuple[str, str], list[dict]] = {}
    for r in sweeps:
        cases.setdefault((r["shape"], r["model"]), []).append(r)
    for (shape, model), rows in cases.items():
        good = [r for r in rows if r.get("ok")]
        if not good:
            print(f"sweep {shape} {model}: no config passed")
            continue
        best = min(good, key=lambda r: r["ms"])
        changed = {k: v for k, v in best["config"].items() if v != rows[0]["config"][k]}
        print(
            f"sweep {shape:24s} {model:9s} default {rows[0].get('ms', float('nan')):7.3f} ms, "
            f"best {best['ms']:7.3f} ms with {changed or 'the default'}"
        )


DECODE_CONFIGS = [AttentionConfig()] + [
    AttentionConfig(block_n=bn, decode_warps=w, num_stages=st)
    for bn, (w, st) in itertools.product((32, 64, 128), ((4, 2), (4, 3), (2, 2), (8, 2)))
] + [AttentionConfig(mha_decode=(bn, w, 1)) for bn, w in ((16, 1), (32, 1), (64, 2))] + [
    AttentionConfig(wide_decode=(32, 1, 2))]
SPLIT_CONFIGS = [AttentionConfig(num_splits=s) for s in (1, 4, 16, 32, 64)]
PREFILL_CONFIGS = [AttentionConfig()] + [
    AttentionConfig(block_m=bm, block_n=bn, prefill_warps=w, num_stages=st)
    for (bm, w), bn, st in itertools.product(((64, 4), (128, 8), (128, 4)), (32, 64, 128), (2, 3))
]


def print_summary(results: list[dict]) -> None:
    print(
        f"\n{'fp16, KV fp16, block 64':24s} {'model':9s} {'max err':>8s} {'kernel ms':>9s} {'ref ms':>8s} "
        f"{'speedup':>7s} {'GB/s':>6s}"
    )
    for r in results:
        if r["dtype"] == "float16" and r["kv"] == "float" and r["block"] == 64:
            print(
                f"{r['shape']:24s} {r['model']:9s} {r['max_err']:8.1e} {r['kernel_ms']:9.3f} {r['reference_ms']:8.3f} "
                f"{r['reference_ms'] / r['kernel_ms']:7.1f} {r['kernel_gbps']:6.0f}"
            )
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["dtype"], r["kv"]), []).append(r)
    print(f"\n{'dtype':8s} {'kv':19s} {'checks':>6s} {'worst err':>9s} {'speedup min..max':>17s}")
    for (dtype, kv), rows in sorted(groups.items()):
        speedups = [r["reference_ms"] / r["kernel_ms"] for r in rows]
        print(
            f"{dtype:8s} {kv:19s} {len(rows):6d} {max(r['max_err'] for r in rows):9.1e} "
            f"{min(speedups):8.1f}..{max(speedups):<8.1f}"
        )


def runs(quick: bool, mha_int8: bool = False) -> list[tuple[Shape, str, torch.dtype, str, int]]:
    if mha_int8:  # the decode shapes wide enough for the CUDA-core kernel, Llama-2-7B's MHA
        return [(shape, "llama2-7b", dtype, kv, 64) for shape in (SHAPES[2], SHAPES[6]) for kv in KV_MODES[1:]
                for dtype in (torch.float16, torch.bfloat16)]
    out = []
    models = ("gqa-32/8", "llama2-7b") if quick else tuple(MODELS)
    for model in models:
        for shape in SHAPES if not quick else SHAPES[::2]:
            out.append((shape, model, torch.float16, "float", 64))
            if not quick or model == "llama2-7b":  # MHA decodes run their own kernel (paged_decode_kernel)
                out.append((shape, model, torch.bfloat16, "float", 64))
        for kv in KV_MODES[1:]:
            for shape in (SHAPES[0], SHAPES[3]):
                out.append((shape, model, torch.float16, kv, 64))
        out.append((SHAPES[4], model, torch.bfloat16, "int8-online", 16))
        out.append((SHAPES[0], model, torch.float16, "float", 16))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true",
                        help="GQA 32/8 in fp16, Llama-2-7B's MHA in fp16 and bf16, half the shapes, no sweep")
    parser.add_argument("--no-sweep", action="store_true", help="skip the config sweep")
    parser.add_argument("--sweep-only", action="store_true", help="only the config sweep (a second 10-minute call)")
    parser.add_argument("--sweep-decode64", action="store_true",
                        help="only the sweep of batch-64 decode at ~150 tokens of context, MHA and GQA")
    parser.add_argument("--narrow", action="store_true",
                        help="only the one launch (RoPE, write, attention) on narrow MHA decode batches (1 and 8 "
                             "sequences; one split over 4k keys) with LMD_MHA_DECODE_NARROW's blocks (default "
                             "64,4,1), fp16 and bf16")
    parser.add_argument("--mha-int8", action="store_true",
                        help="only the MHA decode checks on int8 KV (the CUDA-core kernel), RoPE and the write folded "
                             "in or not, fp16 and bf16, no sweep")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    if args.narrow:
        from dataclasses import replace

        from lmd.turbomind.kernels.attention_config import default_config

        cfg = default_config(128, torch.float16)
        cfg = replace(cfg, mha_decode_narrow=cfg.mha_decode_narrow or (64, 4, 1))
        print(f"narrow blocks {cfg.mha_decode_narrow}", flush=True)
        results = [check_rope_decode(dtype, gen, kv, shape, cfg) for shape in NARROW_SHAPES
                   for dtype in (torch.float16, torch.bfloat16) for kv in ("float", "int8-online")]
    elif args.sweep_only or args.sweep_decode64:
        results = []
    else:
        results = [check(*run, gen) for run in runs(args.quick, args.mha_int8)]
    if not (args.sweep_only or args.sweep_decode64 or args.narrow):
        kv_modes = KV_MODES[1:] if args.mha_int8 else KV_MODES
        results += [check_rope_decode(dtype, gen, kv) for dtype in (torch.float16, torch.bfloat16) for kv in kv_modes]
    sweeps: list[dict] = []
    if args.sweep_decode64:
        for model in ("llama2-7b", "gqa-32/8"):
            sweeps += sweep(SHAPES[6], model, DECODE_CONFIGS + SPLIT_CONFIGS[1:3], gen)
    elif not (args.quick or args.no_sweep or args.mha_int8 or args.narrow):
        sweeps += sweep(SHAPES[0], "gqa-32/8", DECODE_CONFIGS, gen)
        sweeps += sweep(SHAPES[1], "llama2-7b", DECODE_CONFIGS[:1] + SPLIT_CONFIGS, gen)
        sweeps += sweep(SHAPES[1], "gqa-32/8", DECODE_CONFIGS[:1] + SPLIT_CONFIGS, gen)
        sweeps += sweep(SHAPES[5], "llama2-7b", PREFILL_CONFIGS, gen)
        sweeps += sweep(SHAPES[5], "gqa-32/8", PREFILL_CONFIGS, gen)
    failures = sum(not r["ok"] for r in results)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_attention_tests.json").write_text(
            json.dumps(dict(device=torch.cuda.get_device_name(), checks=results, sweeps=sweeps), indent=1)
        )
    print_sweep_summary(sweeps)
    print_summary(results)
    print(f"{len(results)} checks, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
