"""Paged attention on the Triton kernels (`paged_attention_kernels`): checks, per-batch metadata, launches.

`paged_attention_triton(q, cache, layer, batch, scale)` computes exactly what
`lmd.turbomind.paged_attention.paged_attention_reference` computes (the oracle of the tests): sequences with one new
token run the decode kernel (split-K over the context, then a combine), longer chunks the prefill kernel. The
batch's metadata (per-sequence starts and lengths, padded block tables, prefill tiles) is built once per
ForwardBatch and reused by every layer.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass, field

import torch
import triton

from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.kernels.paged_attention_kernels import _attention_kernel, _combine_kernel
from lmd.turbomind.kv_cache import KVCache

LOG2E = 1.4426950408889634
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int = 64  # prefill rows per program: query tokens x the GQA group padded to a power of two
    block_n: int = 64  # keys per step, both kernels
    prefill_warps: int = 4
    decode_warps: int = 4
    num_stages: int = 2
    num_splits: int = 0  # decode split-K over the context; 0: enough to fill the GPU, each split >= 4 steps


DEFAULT_CONFIG = AttentionConfig()


def default_config(head_dim: int, dtype: torch.dtype) -> AttentionConfig:
    """Block shapes that compile for sm_90 without register spills (ptxas through Triton 3.6) for fp16/bf16 up to
    head dim 256; fp32 (IEEE dots on FMA units) is a correctness path and spills a little at head dim 128."""
    if dtype == torch.float32:
        return AttentionConfig(block_m=32, block_n=32)
    if head_dim > 128:
        return AttentionConfig(block_n=32)
    return DEFAULT_CONFIG


def unsupported_reason(q: torch.Tensor, cache: KVCache) -> str | None:
    """Why the kernels cannot take this call (None: they can). The dispatcher then runs the reference."""
    d = q.shape[-1]
    if q.dtype not in COMPUTE_DTYPES:
        return f"query dtype {q.dtype} (kernels take fp16, bf16, fp32)"
    if d < 16 or d > 256 or d & (d - 1):
        return f"head dim {d} (kernels take powers of two 16..256)"
    if cache.dtype != q.dtype:
        return f"cache compute dtype {cache.dtype} differs from the query's {q.dtype}"
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "CPU tensors need TRITON_INTERPRET=1"
    return None


@dataclass
class _BatchMeta:
    seq_info: torch.Tensor  # [B, 3] int32: first row in the flat batch, query length, context length
    decode_tiles: torch.Tensor  # [num_decode, 2] int32: (sequence, 0) of the sequences with one new token
    tables: torch.Tensor  # [B, max blocks] int32, rows zero-padded
    max_decode_ctx: int
    prefill: list[tuple[int, int, int]]  # (sequence, query length, context length) of the longer chunks
    tiles: dict[int, torch.Tensor] = field(default_factory=dict)  # tokens per tile -> [tiles, 2] int32

    def prefill_tiles(self, block_q: int) -> torch.Tensor:
        """(sequence, first query token) of every tile of block_q tokens, those that see the most keys first (the
        grid's tail is then short tiles)."""
        if block_q not in self.tiles:
            work = [
                (ctx - n + min(q0 + block_q, n), seq, q0) for seq, n, ctx in self.prefill for q0 in range(0, n, block_q)
            ]
            work.sort(reverse=True)
            flat = [x for _, seq, q0 in work for x in (seq, q0)]
            self.tiles[block_q] = torch.tensor(flat, dtype=torch.int32, device=self.seq_info.device).view(-1, 2)
        return self.tiles[block_q]


_last_batch: tuple[weakref.ref, _BatchMeta] | None = None


def _batch_meta(batch: ForwardBatch, device: torch.device) -> _BatchMeta:
    """Built once per batch (every layer of a forward passes the same ForwardBatch object)."""
    global _last_batch
    if isinstance(batch.attention_meta, _BatchMeta):  # static buffers of a decode graph
        return batch.attention_meta
    if _last_batch is not None and _last_batch[0]() is batch:
        return _last_batch[1]
    decode = [i for i, n in enumerate(batch.q_lens) if n == 1]
    prefill = [(i, n, ctx) for i, (n, ctx) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True)) if n > 1]
    host = [x for row in zip(batch.q_starts, batch.q_lens, batch.ctx_lens, strict=True) for x in row]
    host += [x for i in decode for x in (i, 0)]
    packed = torch.tensor(host, dtype=torch.int32, device=device)
    b = len(batch.q_lens)
    tables = torch.nn.utils.rnn.pad_sequence([t.to(device) for t in batch.block_tables], batch_first=True)
    max_decode_ctx = max((batch.ctx_lens[i] for i in decode), default=0)
    meta = _BatchMeta(
        packed[: 3 * b].view(b, 3),
        packed[3 * b :].view(-1, 2),
        tables.to(torch.int32).contiguous(),
        max_decode_ctx,
        prefill,
    )
    _last_batch = (weakref.ref(batch), meta)
    return meta


_static_tables: dict[tuple[int, int], tuple[weakref.ref, torch.Tensor]] = {}


def _static_table(cache: KVCache, layer: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """[4, Hkv, D] fp32 (k_scale, k_zero, v_scale, v_zero) of one layer, per-head params broadcast over D."""
    s = cache.static
    key = (id(s), layer)
    hit = _static_tables.get(key)
    if hit is not None and hit[0]() is s:
        return hit[1]
    for dead in [k for k, (ref, _) in _static_tables.items() if ref() is None]:
        del _static_tables[dead]
    params = (s.k_scale[layer], s.k_zero[layer], s.v_scale[layer], s.v_zero[layer])
    table = torch.stack([p.float().reshape(kv_heads, -1).expand(kv_heads, head_dim) for p in params]).contiguous()
    _static_tables[key] = (weakref.ref(s), table)
    return table


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def decode_splits(programs: int, max_ctx: int, cfg: AttentionConfig, device: torch.device) -> int:
    """Split the context until about two programs run per SM, keeping at least 4 key steps per split."""
    if cfg.num_splits:
        return cfg.num_splits
    steps = triton.cdiv(max_ctx, cfg.block_n)
    splits = 1
    while programs * splits < 2 * _sm_count(device) and steps >= 8 * splits and splits < 64:
        splits *= 2
    return splits


def _check(q: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch) -> None:
    reason = unsupported_reason(q, cache)
    if reason is not None:
        raise ValueError(f"paged_attention_triton: unsupported {reason}")
    k, v = cache.k[layer], cache.v[layer]
    if q.dim() != 3 or q.shape[0] != batch.num_tokens or q.shape[2] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} should be [{batch.num_tokens} tokens, heads, {k.shape[3]}]")
    if q.shape[1] % k.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[2]} KV heads")
    if q.stride(2) != 1 or k.stride() != v.stride() or k.stride(3) != 1:
        raise ValueError("q, k and v need a contiguous head dim, and k and v the same strides")
    if q.device != k.device:
        raise ValueError(f"q on {q.device} but the cache on {k.device}")
    if cache.int8 and cache.static is None:
        kp, vp = cache.k_param[layer], cache.v_param[layer]
        if kp.stride() != vp.stride() or kp.stride(3) != 1 or kp.dtype != torch.float16:
            raise ValueError("online int8 params need fp16 [blocks, block, Hkv, 2] with equal strides")


def paged_attention_triton(
    q: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch, scale: float, config: AttentionConfig | None = None
) -> torch.Tensor:
    """q [T, Hq, D] (new tokens, rotated; their K/V already in the cache) -> out [T, Hq, D] in q's dtype."""
    _check(q, cache, layer, batch)
    cfg = config or default_config(q.shape[2], q.dtype)
    t, num_heads, d = q.shape
    out = torch.empty((t, num_heads, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    k, v = cache.k[layer], cache.v[layer]
    kv_heads = k.shape[2]
    group = num_heads // kv_heads
    g_pad = triton.next_power_of_2(group)
    meta = _batch_meta(batch, q.device)
    kv_mode, kp, vp, static = 0, k, v, k
    if cache.int8 and cache.static is not None:
        kv_mode, static = 1, _static_table(cache, layer, kv_heads, d)
    elif cache.int8:
        kv_mode, kp, vp = 2, cache.k_param[layer], cache.v_param[layer]
    strides = (
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        meta.tables.stride(0),
        *k.stride()[:3],
        *kp.stride()[:3],
    )
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"

    def launch(
        tiles: torch.Tensor, part: torch.Tensor, part_ml: torch.Tensor, g_rows: int, block_m: int, splits: int, warps: int
    ) -> None:
        _attention_kernel[(tiles.shape[0], kv_heads, splits)](
            q,
            out,
            part,
            part_ml,
            k,
            v,
            kp,
            vp,
            static,
            meta.tables,
            meta.seq_info,
            tiles,
            scale * LOG2E,
            kv_heads,
            *strides,
            GROUP=group,
            G_ROWS=g_rows,
            BLOCK_M=block_m,
            BLOCK_N=cfg.block_n,
            HEAD_DIM=d,
            BLOCK_SIZE=cache.block_size,
            KV_MODE=kv_mode,
            SPLITS=splits,
            DOT_PRECISION=dot_precision,
            num_warps=warps,
            num_stages=cfg.num_stages,
        )

    if meta.prefill:
        block_m = max(cfg.block_m, g_pad, 16)
        launch(meta.prefill_tiles(block_m // g_pad), out, out, g_pad, block_m, 1, cfg.prefill_warps)
    num_decode = meta.decode_tiles.shape[0]
    if num_decode:
        splits = decode_splits(num_decode * kv_heads, meta.max_decode_ctx, cfg, q.device)
        rows = max(16, g_pad)
        if splits == 1:
            launch(meta.decode_tiles, out, out, rows, rows, 1, cfg.decode_warps)
            return out
        part = torch.empty((num_decode, num_heads, splits, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_decode, num_heads, splits, 2), dtype=torch.float32, device=q.device)
        launch(meta.decode_tiles, part, part_ml, rows, rows, splits, cfg.decode_warps)
        _combine_kernel[(num_decode, num_heads)](
            part,
            part_ml,
            out,
            meta.seq_info,
            meta.decode_tiles,
            num_heads,
            out.stride(0),
            out.stride(1),
            SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits),
            HEAD_DIM=d,
            num_warps=1,
        )
    return out
