"""The Triton paged-attention kernels (Triton's CPU interpreter, small shapes) against paged_attention_reference.

All cases run in one fresh process (this file run as a script): TRITON_INTERPRET must be set before Triton decorates
the kernels. Each case fills a paged cache (the pool first poisoned with NaN, block ids shuffled) through
KVCache.write, so the kernel reads exactly what the engine would store; the script prints one JSON object, case name
-> max abs error (or the exception text), and the tests assert on each entry.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import zlib
from dataclasses import dataclass

import pytest

from tests.turbomind.kernels.interpreter import run_jobs

TOL = {"fp32": 2e-5, "fp16": 4e-3}  # fp16: the kernel rounds P to fp16 before P @ V (flash-attention style)


@dataclass(frozen=True)
class Case:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (new tokens, cached tokens before them) per sequence
    dtype: str = "fp32"
    kv: str = "float"  # float | static-head | static-channel | online
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    splits: int = 0  # decode split-K (0: the wrapper's choice)
    block_m: int = 16
    block_n: int = 16
    wide_decode: tuple[int, int, int] | None = None  # on CPU every decode launch has programs enough for it
    mha_decode: tuple[int, int, int] | None = None  # the CUDA-core decode kernel (one query head per KV head, wide)
    mha_decode_int8: tuple[int, int, int] | None = None  # ... its blocks on int8 codes


DECODES = ((1, 0), (1, 16), (1, 49), (1, 99))
MIXED = ((1, 40), (13, 0), (1, 7), (21, 30), (2, 63))
CASES = (
    Case("decode-mha", DECODES, q_heads=2),
    Case("decode-fp16-wide-bn32", DECODES, "fp16", q_heads=4, block_size=32, splits=1, wide_decode=(32, 1, 2)),
    Case("decode-gqa4-split3", DECODES, q_heads=8, splits=3),
    # the CUDA-core MHA kernel: one block id a step (block_n divides the block), per key (it does not), split
    Case("decode-mha-cuda-core", DECODES, q_heads=2, splits=1, mha_decode=(16, 1, 2)),
    Case("decode-mha-cuda-core-fp16-d128-bn32-bs16", DECODES, "fp16", q_heads=2, head_dim=128, splits=1,
         mha_decode=(32, 2, 1)),
    Case("decode-mha-cuda-core-split3", DECODES, q_heads=2, splits=3, mha_decode=(8, 1, 2)),
    Case("mixed-mha-cuda-core-fp16-split2", MIXED, "fp16", q_heads=4, kv_heads=4, block_size=32, splits=2,
         mha_decode=(16, 1, 1)),  # 2 decodes x 4 heads: the 8 programs a (CPU: 1) SM that the kernel needs
    # ... on int8 codes: online params per token, static per channel, split
    Case("decode-mha-cuda-core-int8-online", DECODES, kv="online", q_heads=2, splits=1, mha_decode=(16, 1, 2)),
    Case("decode-mha-cuda-core-int8-online-fp16-split3", DECODES, "fp16", kv="online", q_heads=2, splits=3,
         mha_decode=(8, 1, 2)),
    Case("decode-mha-cuda-core-int8-online-bn64-bs16", DECODES, kv="online", q_heads=2, splits=1,
         mha_decode=(16, 1, 1), mha_decode_int8=(64, 2, 1)),
    # the default int8 shape (128 keys a step) over 16-token blocks, fp16, head dim 128, split in 2
    Case("decode-mha-cuda-core-int8-online-fp16-bn128-d128", DECODES, "fp16", kv="online", q_heads=2, head_dim=128,
         splits=2, mha_decode=(32, 1, 1), mha_decode_int8=(128, 4, 1)),
    Case("decode-mha-cuda-core-int8-static-channel-fp16-d128", DECODES, "fp16", kv="static-channel", q_heads=2,
         head_dim=128, block_size=32, splits=2, mha_decode=(32, 1, 1)),
    Case("mixed-mha-cuda-core-int8-static-head", MIXED, kv="static-head", q_heads=4, kv_heads=4, splits=1,
         mha_decode=(16, 1, 1)),
    Case("decode-fp16-d128-bs32-split4", ((1, 32), (1, 69), (1, 128)), "fp16", head_dim=128, block_size=32, splits=4),
    Case("prefill-gqa3", ((37, 0), (20, 0)), q_heads=6),
    Case("prefill-chunk-fp16-d128-bs64", ((24, 40), (9, 7)), "fp16", head_dim=128, block_size=64, block_m=32),
    Case("mixed-bs32", MIXED, block_size=32, splits=2),
    Case("mixed-fp16-gqa4-bn32", MIXED, "fp16", q_heads=8, block_m=64, block_n=32),
    Case("int8-static-head", MIXED, kv="static-head", splits=2),
    Case("int8-static-channel-fp16", MIXED, "fp16", kv="static-channel", head_dim=128, block_size=32),
    Case("int8-online", MIXED, kv="online", block_size=64, splits=4),
    Case("int8-online-fp16-gqa4", MIXED, "fp16", kv="online", q_heads=8),
)
ENGINE_CHECKS = ("engine-fp32", "engine-int8-online", "engine-decode-graph")
MHA_ROPE_ENGINE = {"engine-mha-rope-decode": {}, "engine-mha-rope-decode-int8-online": {"quant_policy": 4},
                   # one sequence: 4 programs, a narrow launch (LMD_MHA_DECODE_NARROW)
                   "engine-mha-rope-decode-narrow": {"narrow": "16,1,1"}}
DISPATCHED = "dispatch-default-config-fp16"  # paged_attention() with LMD_ATTENTION=triton, default block shapes


def _fill_cache(case: Case, gen, dtype):
    """A cache holding every sequence's K/V in shuffled blocks, its batch, and the batch's queries."""
    import torch

    from lmd.turbomind.forward_batch import ForwardBatch
    from lmd.turbomind.kv_cache import KVCache
    from lmd.turbomind.kv_int8 import StaticKVParams

    bs, hkv, d = case.block_size, case.kv_heads, case.head_dim
    need = [-(-(n + start) // bs) for n, start in case.seqs]
    num_blocks = sum(need) + 3
    static = None
    if case.kv.startswith("static"):
        width = 1 if case.kv == "static-head" else d
        params = [
            torch.rand(hkv, width, generator=gen) * 0.02 + 0.02
            if i % 2 == 0
            else torch.randn(hkv, width, generator=gen) * 0.3
            for i in range(4)
        ]
        static = StaticKVParams(*((p,) for p in params))
    cache = KVCache(1, num_blocks, bs, hkv, d, dtype, torch.device("cpu"), int8=case.kv != "float", static_params=static)
    for t in (cache.k[0], cache.v[0]) if case.kv == "float" else (*cache.k_param, *cache.v_param):
        t.fill_(float("nan"))  # a key read past a sequence's end would poison its row
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    chunks = []
    for (n, start), count in zip(case.seqs, need, strict=True):
        table, ids = ids[:count], ids[count:]
        chunks.append((list(range(n)), start, table))
        prefix = ForwardBatch.build([(list(range(start + n)), 0, table)], bs, [], torch.device("cpu"))
        k = torch.randn(start + n, hkv, d, generator=gen) * 2
        cache.write(0, k.to(dtype), torch.randn(start + n, hkv, d, generator=gen).to(dtype), prefix.slots)
    batch = ForwardBatch.build(chunks, bs, [], torch.device("cpu"))
    q = torch.randn(batch.num_tokens, case.q_heads, d, generator=gen).to(dtype)
    return cache, batch, q


def run_case(case: Case) -> float:
    import torch

    from lmd.turbomind.kernels.paged_attention import AttentionConfig
    from lmd.turbomind.paged_attention import paged_attention_reference, paged_attention_triton_on_cache

    dtype = {"fp32": torch.float32, "fp16": torch.float16}[case.dtype]
    cache, batch, q = _fill_cache(case, torch.Generator().manual_seed(zlib.crc32(case.name.encode())), dtype)
    scale = case.head_dim**-0.5
    ref = paged_attention_reference(q, cache, 0, batch, scale, fused=False).float()
    cfg = AttentionConfig(block_m=case.block_m, block_n=case.block_n, num_splits=case.splits,
                          wide_decode=case.wide_decode, mha_decode=case.mha_decode,
                          mha_decode_int8=case.mha_decode_int8)
    out = paged_attention_triton_on_cache(q, cache, 0, batch, scale, cfg)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(ref).all()
    return (out.float() - ref).abs().max().item()


ROPE_CASES = {
    "rope-decode-fp32-full": ("fp32", 64, "float"),
    "rope-decode-fp16-partial": ("fp16", 32, "float"),
    "rope-decode-int8-online-fp32-full": ("fp32", 64, "online"),
    "rope-decode-int8-online-fp16-partial": ("fp16", 32, "online"),
    "rope-decode-int8-static-channel-fp16": ("fp16", 64, "static-channel"),
    # one decode (a narrow launch), unsplit or split over the context (the last split also takes the new key; with
    # 4 splits of 32 keys over 69 cached ones it takes nothing else)
    "rope-decode-narrow-fp16-partial": ("fp16", 32, "float", 1),
    "rope-decode-narrow-split4-fp16": ("fp16", 64, "float", 4),
    "rope-decode-narrow-split2-int8-online-fp16": ("fp16", 64, "online", 2),
    "rope-decode-narrow-split3-int8-static-fp32": ("fp32", 32, "static-channel", 3),
}


def run_rope_decode(dtype_name: str, rot: int, kv: str, narrow_splits: int = 0) -> list[float]:
    """RoPE + KV write + decode attention in one launch against the two-step reference (rotate, write, attend):
    [output error, largest difference of the K/V the two caches read back (int8: dequantized), 1 if it declined
    where it must, the reference's largest int8 step (0 for float)]. Four decodes x 4 heads (wide on a CPU's one
    'SM'; declined: a batch with a prefill chunk), or with narrow_splits: one decode (4 programs, the
    `mha_decode_narrow` shape, the context in that many splits; declined: the same call with no narrow shape set)."""
    import torch

    from lmd.turbomind.kernels.paged_attention import AttentionConfig, attention_meta
    from lmd.turbomind.kernels.paged_decode import rope_decode_attention
    from lmd.turbomind.paged_attention import _int8_params, paged_attention_reference
    from lmd.turbomind.rope import rotary_qkv_reference

    dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype_name]
    heads, d = 4, 64
    narrow = narrow_splits > 0
    seqs = ((1, 70),) if narrow else ((1, 0), (1, 16), (1, 40), (1, 70))
    case = Case("rope", seqs, dtype_name, kv, q_heads=heads, kv_heads=heads, head_dim=d)
    caches = [_fill_cache(case, torch.Generator().manual_seed(5), dtype)[:2] for _ in range(2)]
    (ref_cache, batch), (cache, _) = caches
    g = torch.Generator().manual_seed(6)
    t = len(case.seqs)
    qkv = torch.randn(t, 3 * heads * d, generator=g).to(dtype)
    angles = torch.rand(t, rot // 2, generator=g) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    scale = d**-0.5
    q, k, v = rotary_qkv_reference(qkv, cos, sin, heads, heads, d)
    ref_cache.write(0, k, v, batch.slots)
    ref = paged_attention_reference(q, ref_cache, 0, batch, scale, fused=False).float()
    meta = attention_meta(batch.q_starts, batch.q_lens, batch.ctx_lens, batch.block_tables, qkv.device)
    splits = narrow_splits if narrow_splits > 1 else 0
    cfg = AttentionConfig(mha_decode=(16, 1, 1), mha_decode_narrow=(16, 1, 1) if narrow else None, num_splits=splits)
    params = _int8_params(cache, 0)
    out = rope_decode_attention(qkv, cos, sin, batch.slots, cache.k[0], cache.v[0], meta, scale, heads, cfg,
                                **params)
    pools = 0.0
    for table, ctx in zip(batch.block_tables, batch.ctx_lens, strict=True):
        for a, b in zip(cache.read(0, table, ctx), ref_cache.read(0, table, ctx), strict=True):
            pools = max(pools, (a.float() - b.float()).abs().max().item())
    step = 0.0
    if kv == "online":
        step = max(p[..., 0].float().nan_to_num(0.0).max().item() for p in (ref_cache.k_param[0], ref_cache.v_param[0]))
    elif kv.startswith("static"):
        step = max(ref_cache.static.k_scale[0].max().item(), ref_cache.static.v_scale[0].max().item())
    if narrow:
        declined = rope_decode_attention(qkv, cos, sin, batch.slots, cache.k[0], cache.v[0], meta, scale, heads,
                                         AttentionConfig(mha_decode=(16, 1, 1), num_splits=splits), **params) is None
        return [(out.float() - ref).abs().max().item(), pools, float(declined), step]
    mixed = Case("rope-mixed", MIXED, dtype_name, kv, q_heads=heads, kv_heads=heads, head_dim=d)
    mcache, mbatch, _ = _fill_cache(mixed, torch.Generator().manual_seed(7), dtype)
    mmeta = attention_meta(mbatch.q_starts, mbatch.q_lens, mbatch.ctx_lens, mbatch.block_tables, qkv.device)
    rows = mbatch.slots.shape[0]
    one = (cos[:1].expand(rows, -1).contiguous(), sin[:1].expand(rows, -1).contiguous())
    declined = rope_decode_attention(torch.zeros(rows, 3 * heads * d, dtype=dtype), *one, mbatch.slots,
                                     mcache.k[0], mcache.v[0], mmeta, scale, heads, cfg,
                                     **_int8_params(mcache, 0)) is None
    return [(out.float() - ref).abs().max().item(), pools, float(declined), step]


def run_dispatched() -> float:
    import torch

    from lmd.turbomind.paged_attention import paged_attention, paged_attention_reference

    case = Case(DISPATCHED, ((1, 70), (50, 20), (3, 0)), "fp16", q_heads=4, kv_heads=1, head_dim=64)
    cache, batch, q = _fill_cache(case, torch.Generator().manual_seed(7), torch.float16)
    os.environ["LMD_ATTENTION"] = "triton"
    out = paged_attention(q, cache, 0, batch, 0.125)
    os.environ["LMD_ATTENTION"] = "reference"
    return (out.float() - paged_attention_reference(q, cache, 0, batch, 0.125, fused=False).float()).abs().max().item()


def run_bad_shapes() -> list[str]:
    """The kernel module's own checks, called with tensors as the engine side unpacks them."""
    import torch

    from lmd.turbomind.kernels.paged_attention import attention_meta, paged_attention_triton

    cache, batch, q = _fill_cache(Case("bad", ((3, 2),)), torch.Generator().manual_seed(3), torch.float32)
    meta = attention_meta(batch.q_starts, batch.q_lens, batch.ctx_lens, batch.block_tables, q.device)
    k, v = cache.k[0], cache.v[0]
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    calls = [(bad, k, v) for bad in (q[:2], q[:, :3], q.to(torch.float16), strided)]
    calls.append((q, k.to(torch.int8), v.to(torch.int8)))  # int8 codes without their params
    messages = []
    for query, kc, vc in calls:
        try:
            paged_attention_triton(query, kc, vc, meta, 0.1)
            messages.append("accepted")
        except ValueError as e:
            messages.append(str(e))
    return messages


def engine_logits(ws: str, attention: str, **overrides):
    """A tiny model's logits over three steps with shuffled block tables: two prefills; a decode beside a prefill
    chunk over cached tokens; two decodes."""
    import torch

    from lmd.turbomind.forward_batch import ForwardBatch
    from lmd.turbomind.model_runner import ModelRunner
    from lmd.turbomind.workspace import open_workspace

    os.environ["LMD_ATTENTION"] = attention
    runner = ModelRunner(open_workspace(ws, cache_block_seq_len=16, cache_max_entry_count=16, **overrides))
    a, b = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(11)).tolist(), list(range(5, 40))
    ta, tb = [9, 2, 14], [5, 0, 11]
    steps = (
        [(a[:20], 0, ta), (b[:3], 0, tb)],
        [(a[20:21], 20, ta), (b[3:30], 3, tb)],
        [(a[21:22], 21, ta), (b[30:31], 30, tb)],
    )
    logits = []
    for chunks in steps:
        rows = sum(len(c[0]) for c in chunks)
        logits.append(
            runner.model.forward(ForwardBatch.build(chunks, 16, list(range(rows)), runner.device), runner.cache)
        )
    os.environ["LMD_ATTENTION"] = "reference"
    return torch.cat(logits)


def decode_graph_logits(ws: str) -> tuple:
    """One decode step of three sequences (block tables shuffled) on the reference path, then on the decode graphs'
    static buffers (run eagerly) with the Triton kernels: bucket 4, so one padding row in the scratch block."""
    import torch

    from lmd.turbomind.model_runner import ModelRunner
    from lmd.turbomind.workspace import open_workspace

    os.environ["LMD_ATTENTION"] = "reference"
    runner = ModelRunner(open_workspace(ws, cache_block_seq_len=16, cache_max_entry_count=16, max_batch_size=4,
                                        session_len=256))
    ids = torch.randint(0, 49152, (80,), generator=torch.Generator().manual_seed(12)).tolist()
    a, b, c = ids[:21], ids[21:57], ids[57:61]
    ta, tb, tc = [9, 2, 14], [5, 0, 11], [7]
    runner.run_chunks([(a[:20], 0, ta), (b[:35], 0, tb), (c[:3], 0, tc)], [19, 54, 57])
    step = [(a[20:], 20, ta), (b[35:], 35, tb), (c[3:], 3, tc)]
    ref = runner.run_chunks(step, [0, 1, 2])
    os.environ["LMD_ATTENTION"] = "triton"
    runner.enable_decode_graphs(capture=False)
    tri = runner.graphs.run(step)
    os.environ["LMD_ATTENTION"] = "reference"
    return ref, tri


def mha_rope_decode_logits(narrow: str = "", **overrides) -> tuple:
    """A tiny fp16 MHA Llama (4 query heads, 4 KV heads): prompts on the reference path, then one decode step of
    three sequences on the Triton kernels: as the rotary kernel then the attention, and with RoPE, the KV write and
    the attention as one launch (3 x 4 programs: wide enough on a CPU's one 'SM'), eagerly and on the decode
    graphs' buffers. Also how many layer calls took the one launch. `narrow`: LMD_MHA_DECODE_NARROW's value, and
    the first sequence alone (a narrow launch)."""
    import tempfile
    from pathlib import Path

    import torch

    from lmd.turbomind.kernels import paged_decode as kernels
    from lmd.turbomind.model_runner import ModelRunner
    from lmd.turbomind.workspace import open_workspace
    from tests.conftest import deploy_tiny

    fused = []
    plain = kernels.rope_decode_attention
    one_launch = [False]

    def counted(*args, **kwargs):
        out = plain(*args, **kwargs) if one_launch[0] else None
        fused.append(out is not None)
        return out

    kernels.rope_decode_attention = counted
    ids = torch.randint(0, 49152, (80,), generator=torch.Generator().manual_seed(13)).tolist()
    a, b, c = ids[:21], ids[21:57], ids[57:61]
    tables = [9, 2, 14], [5, 0, 11], [7]
    prompts = [(a[:20], 0, tables[0]), (b[:35], 0, tables[1]), (c[:3], 0, tables[2])]
    step = [(a[20:], 20, tables[0]), (b[35:], 35, tables[1]), (c[3:], 3, tables[2])]
    last_rows = [19, 54, 57]
    if narrow:
        prompts, step, last_rows = prompts[:1], step[:1], last_rows[:1]
        os.environ["LMD_MHA_DECODE_NARROW"] = narrow
    logits = []
    with tempfile.TemporaryDirectory() as tmp:
        _, ws = deploy_tiny(Path(tmp), "llama", num_key_value_heads=4)
        for one_launch[0] in (False, True):
            os.environ["LMD_ATTENTION"] = os.environ["LMD_LAYER_OPS"] = "reference"
            runner = ModelRunner(open_workspace(str(ws), cache_block_seq_len=16, cache_max_entry_count=16,
                                                max_batch_size=4, session_len=256, dtype="fp16", **overrides))
            runner.run_chunks(prompts, last_rows)
            os.environ["LMD_ATTENTION"] = os.environ["LMD_LAYER_OPS"] = "triton"
            logits.append(runner.run_chunks(step, list(range(len(step)))).float())
        # the same step again on the decode graphs' static buffers (eager): bucket 4 (narrow: 1), one padding row
        # writing its scratch slot (the step's own slots are written again with the same values)
        runner.enable_decode_graphs(capture=False)
        logits.append(runner.graphs.run(step).float())
    os.environ["LMD_ATTENTION"] = "reference"
    os.environ.pop("LMD_LAYER_OPS")
    os.environ.pop("LMD_MHA_DECODE_NARROW", None)
    kernels.rope_decode_attention = plain
    return logits[0], logits[1], logits[2], sum(fused)


def run_engine(ws: str) -> dict[str, float]:
    out = {}
    for name, overrides in (("engine-fp32", {}), ("engine-int8-online", {"quant_policy": 4})):
        ref, tri = engine_logits(ws, "reference", **overrides), engine_logits(ws, "triton", **overrides)
        out[name] = ((tri - ref).abs().max() / (ref.amax(-1) - ref.amin(-1)).max()).item()
    ref, tri = decode_graph_logits(ws)
    out["engine-decode-graph"] = ((tri - ref).abs().max() / (ref.amax(-1) - ref.amin(-1)).max()).item()
    for name, overrides in MHA_ROPE_ENGINE.items():
        ref, tri, graph, fused_layers = mha_rope_decode_logits(**overrides)
        out[name] = max(((x - ref).abs().max() / (ref.amax(-1) - ref.amin(-1)).max()).item() for x in (tri, graph))
        out[f"{name}-layers"] = fused_layers
    return out


def main(ws: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    jobs = {c.name: (lambda c=c: run_case(c)) for c in CASES} | {DISPATCHED: run_dispatched,
                                                                  "bad-shapes": run_bad_shapes}
    jobs |= {name: (lambda a=args: run_rope_decode(*a)) for name, args in ROPE_CASES.items()}
    results = run_jobs(jobs)
    try:
        results.update(run_engine(ws))
    except Exception:
        failed = traceback.format_exc(limit=4)
        for name in (*ENGINE_CHECKS, *MHA_ROPE_ENGINE, *(f"{n}-layers" for n in MHA_ROPE_ENGINE)):
            results.setdefault(name, failed)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_matches_reference(interpreted: dict, case: Case) -> None:
    err = interpreted[case.name]
    assert isinstance(err, float), err
    assert err < TOL[case.dtype], f"{case.name}: max abs error {err:.2e}"


@pytest.mark.parametrize("name", ROPE_CASES)
def test_rope_decode_matches_rotate_write_attend(interpreted: dict, name: str) -> None:
    result = interpreted[name]
    assert isinstance(result, list), result
    out_err, pool_err, declined, step = result
    # one launch differs from rotate, write, attend by the rounding of the rotation (one FMA against two products,
    # one unit in the last place of the stored key) and the order of one softmax sum
    dtype, _, kv, *_ = ROPE_CASES[name]
    tol = TOL[dtype]
    if kv == "float":
        assert out_err <= tol and pool_err <= tol * 2 and declined == 1.0
        return
    # int8: the codes are the reference's except where the rotation's last-place difference crosses a rounding
    # boundary (one code step there); the output sees such a step weighted by its key's probability
    assert 0 < step < 0.2 and pool_err <= step * 1.01 + tol and out_err <= tol + step / 4 and declined == 1.0


def test_dispatch_runs_the_kernel_when_asked(interpreted: dict) -> None:
    err = interpreted[DISPATCHED]
    assert isinstance(err, float), err
    assert err < TOL["fp16"]


def test_wrapper_rejects_bad_queries(interpreted: dict) -> None:
    tokens, heads, dtype, strides, int8 = interpreted["bad-shapes"]
    assert "tokens" in tokens and "multiple" in heads
    assert "differs" in dtype and "contiguous head dim" in strides
    assert "k_param and v_param" in int8


@pytest.mark.parametrize("name", ENGINE_CHECKS)
def test_engine_logits_match_the_reference_path(interpreted: dict, name: str) -> None:
    err = interpreted[name]
    assert isinstance(err, float), err
    assert err < 1e-5, f"{name}: logits differ by {err:.2e} of their range"


@pytest.mark.parametrize("name", MHA_ROPE_ENGINE)
def test_mha_decode_in_one_launch_matches_two(interpreted: dict, name: str) -> None:
    err = interpreted[name]
    assert isinstance(err, float), err
    # fp16: the rotation rounded once instead of twice, one softmax sum in another order (int8: a code one step
    # off where that rounding crosses a boundary)
    assert err < 2e-3, f"logits differ by {err:.2e} of their range"
    assert interpreted[f"{name}-layers"] == 4  # both layers, eager and on the graphs' buffers


def test_unknown_attention_choice_is_refused(monkeypatch) -> None:
    import torch

    from lmd.errors import LmdError
    from lmd.turbomind.paged_attention import paged_attention

    monkeypatch.setenv("LMD_ATTENTION", "flash")
    with pytest.raises(LmdError, match="LMD_ATTENTION='flash'"):
        paged_attention(torch.zeros(1, 1, 16), None, 0, None, 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("choice", "cuda", "want"), [(None, True, True), (None, False, False), ("auto", True, True),
                                                      ("reference", True, False), ("triton", False, True)])
def test_attention_choice_defaults_to_triton_on_cuda_only(monkeypatch, choice, cuda, want) -> None:
    from lmd.turbomind import paged_attention as pa

    class FakeQ:  # only the device matters to the choice
        is_cuda = cuda

    if choice is None:
        monkeypatch.delenv("LMD_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("LMD_ATTENTION", choice)
    assert pa._triton_requested(FakeQ()) is want  # type: ignore[arg-type]


def test_mha_launch_takes_int8_params_that_fit_the_cache_only() -> None:
    import torch

    from lmd.turbomind.kernels.paged_decode import kv_mode_args

    codes, pool = torch.zeros(3, 16, 2, 64, dtype=torch.int8), torch.zeros(3, 16, 2, 64, dtype=torch.float16)
    params = torch.zeros(3, 16, 2, 2, dtype=torch.float16)
    table = torch.zeros(4, 2, 64)
    assert kv_mode_args(pool, None, None, None)[0] == 0
    assert kv_mode_args(codes, params, params.clone(), None)[0] == 2
    assert kv_mode_args(codes, None, None, table)[0] == 1
    assert kv_mode_args(pool, params, params, None) is None  # a float cache takes no params
    assert kv_mode_args(codes, None, None, None) is None  # codes without their params
    assert kv_mode_args(codes, params, params.float(), None) is None
    assert kv_mode_args(codes, params[:, :8], params[:, :8], None) is None  # not the cache's slots
    assert kv_mode_args(codes, params, params, table[:, :1]) is None
    assert kv_mode_args(codes, None, None, table.half()) is None


def test_int8_mha_blocks_come_from_the_environment(monkeypatch) -> None:
    import torch

    from lmd.errors import LmdError
    from lmd.turbomind.kernels.attention_config import default_config

    monkeypatch.setenv("LMD_MHA_DECODE_INT8", "64,2,1")
    cfg = default_config(128, torch.float16)
    assert cfg.mha_decode_int8 == (64, 2, 1)
    for bad in ("64", "48,1,1", "64,3,1", "a,b,c"):
        monkeypatch.setenv("LMD_MHA_DECODE_INT8", bad)
        with pytest.raises(LmdError, match="LMD_MHA_DECODE_INT8"):
            default_config(128, torch.float16)


def test_narrow_mha_blocks_come_from_the_environment(monkeypatch) -> None:
    import torch

    from lmd.errors import LmdError
    from lmd.turbomind.kernels.attention_config import AttentionConfig, default_config, mha_rope_blocks

    assert default_config(128, torch.float16).mha_decode_narrow is None
    monkeypatch.setenv("LMD_MHA_DECODE_NARROW", "64,4,1")
    cfg = default_config(128, torch.float16)
    assert cfg.mha_decode_narrow == (64, 4, 1) and cfg.mha_decode_int8 == (128, 4, 1)  # the default, untouched
    cpu = torch.device("cpu")  # one 'SM': 8 programs are a wide launch
    assert mha_rope_blocks(4, False, cfg, cpu) == (64, 4, 1)
    assert mha_rope_blocks(16, True, cfg, cpu) == (128, 4, 1)  # wide: the int8 shape
    assert mha_rope_blocks(16, False, cfg, cpu) == cfg.mha_decode
    assert mha_rope_blocks(4, False, AttentionConfig(mha_decode=(32, 1, 1)), cpu) is None
    monkeypatch.setenv("LMD_MHA_DECODE_NARROW", "64,4")
    with pytest.raises(LmdError, match="LMD_MHA_DECODE_NARROW"):
        default_config(128, torch.float16)
