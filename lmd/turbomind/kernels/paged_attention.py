"""Paged attention on the Triton kernels (`paged_attention_kernels`): checks, per-batch metadata, launches.

`paged_attention_triton(q, k, v, meta, scale)` computes, for the flat batch that `meta` describes, exactly what
`lmd.turbomind.paged_attention.paged_attention_reference` computes on an engine cache (the oracle of the tests):
sequences with one new token run the decode kernel (split-K over the context, then a combine), longer chunks the
prefill kernel. It takes tensors only; the engine side (`lmd.turbomind.paged_attention`) unpacks its KVCache:

    q                 [T, Hq, D]                        fp16, bf16 or fp32: the new tokens, rotated (K/V stored)
    k, v              [num_blocks, block_size, Hkv, D]  one layer's block pools, in q's dtype or int8 codes
    k_param, v_param  [num_blocks, block_size, Hkv, 2]  online int8: fp16 (scale, zero) per token and head
    static            [4, Hkv, D]                       static int8: fp32 (k_scale, k_zero, v_scale, v_zero)
    meta              AttentionMeta                     from `attention_meta`: the batch's lengths and block tables

Int8 codes come with either k_param and v_param or static, and are dequantized to q's dtype. Sequence i owns rows
[q_starts[i], q_starts[i] + q_lens[i]) of q, at positions [ctx_lens[i] - q_lens[i], ctx_lens[i]) of its sequence,
whose K/V sit in the blocks block_tables[i]. One AttentionMeta serves every layer of a forward (the caller builds it
once per batch).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import triton

from lmd.turbomind.kernels.host_copy import to_device
from lmd.turbomind.kernels.paged_attention_kernels import _attention_kernel, _combine_kernel
from lmd.turbomind.kernels.paged_decode_kernel import _decode_mha_kernel
from lmd.turbomind.kernels.pdl import pdl_options

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
    # (block_n, warps, stages) of an unsplit float-KV decode launch with at least WIDE_PROGRAMS_PER_SM programs per
    # SM; None: the fields above. Batch 64 x 32 KV heads on an H200: 32 keys a step on 1 warp, 2 stages is 2-4 %
    # faster alone at contexts 128-256 (level at 1024); a batch-64 step's attention went 2.12 -> 1.93 ms with it (two
    # calls); at batch 16 (4 programs per SM) it is slower (docs/benchmarks.md, eighteenth session)
    wide_decode: tuple[int, int, int] | None = None
    # (block_n, warps, stages) of a float-KV decode launch of at least WIDE_PROGRAMS_PER_SM programs per SM with one
    # query head per KV head, on the CUDA-core kernel (`paged_decode_kernel`); None: the dot kernel. Its loads are not
    # pipelined, so it needs many programs: at batch 64 it is 8 % faster than the dot kernel's wide config, at batch
    # 16 up to 40 % slower (docs/benchmarks.md, twentieth session)
    mha_decode: tuple[int, int, int] | None = None


WIDE_PROGRAMS_PER_SM = 8
# mha_decode: 32 keys a step on 1 warp is 126 registers for head dim 128 (Triton 3.6, sm_90a): 16 programs an SM, so
# batch 64 x 32 heads fits one wave, where the dot kernel's wide config (220 registers) took 1.72
DEFAULT_CONFIG = AttentionConfig(wide_decode=(32, 1, 2), mha_decode=(32, 1, 1))


def default_config(head_dim: int, dtype: torch.dtype) -> AttentionConfig:
    """Block shapes that compile for sm_90 without register spills (ptxas through Triton 3.6) for fp16/bf16 up to
    head dim 256; fp32 (IEEE dots on FMA units) is a correctness path and spills a little at head dim 128."""
    if dtype == torch.float32:
        return AttentionConfig(block_m=32, block_n=32)
    if head_dim > 128:
        return AttentionConfig(block_n=32)
    return DEFAULT_CONFIG


def unsupported_reason(q: torch.Tensor, kv_dtype: torch.dtype) -> str | None:
    """Why the kernels cannot take queries like q over K/V attended in kv_dtype (the cache's compute dtype, which
    int8 codes dequantize to); None: they can. The dispatcher then runs the reference."""
    d = q.shape[-1]
    if q.dtype not in COMPUTE_DTYPES:
        return f"query dtype {q.dtype} (kernels take fp16, bf16, fp32)"
    if d < 16 or d > 256 or d & (d - 1):
        return f"head dim {d} (kernels take powers of two 16..256)"
    if kv_dtype != q.dtype:
        return f"cache compute dtype {kv_dtype} differs from the query's {q.dtype}"
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "CPU tensors need TRITON_INTERPRET=1"
    return None


@dataclass
class AttentionMeta:
    num_tokens: int  # rows of the flat batch (q's first dim)
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
            self.tiles[block_q] = to_device(flat, torch.int32, self.seq_info.device).view(-1, 2)
        return self.tiles[block_q]


def attention_meta(
    q_starts: Sequence[int],
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    block_tables: Sequence[torch.Tensor],
    device: torch.device,
) -> AttentionMeta:
    """The kernels' metadata of a batch: one host-to-device copy for the lengths, one for the tables, neither
    waiting for the GPU.

    Triton compiles a kernel again for every new specialization of its arguments (an int equal to 1 or divisible by
    16, a pointer aligned to 16 bytes), a host stall inside some step on a fresh machine. So the decode tiles start
    16-byte aligned in the packed copy and the tables' row stride is a multiple of 16 columns whatever the batch:
    the kernels see one specialization."""
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    prefill = [(i, n, ctx) for i, (n, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)) if n > 1]
    b = len(q_lens)
    host = [x for row in zip(q_starts, q_lens, ctx_lens, strict=True) for x in row]
    tiles_at = -(-3 * b // 4) * 4
    host += [0] * (tiles_at - 3 * b) + [x for i in decode for x in (i, 0)]
    packed = to_device(host, torch.int32, device)
    if b:  # ForwardBatch.build keeps the tables on the host: padded there, one copy
        padded = torch.nn.utils.rnn.pad_sequence([t.cpu() for t in block_tables], batch_first=True)
        width = max(16, -(-padded.shape[1] // 16) * 16)
        tables = to_device(torch.nn.functional.pad(padded, (0, width - padded.shape[1])), torch.int32, device)
    else:
        tables = torch.zeros((0, 0), dtype=torch.int32, device=device)
    max_decode_ctx = max((ctx_lens[i] for i in decode), default=0)
    return AttentionMeta(
        sum(q_lens),
        packed[: 3 * b].view(b, 3),
        packed[tiles_at:].view(-1, 2),
        tables.to(torch.int32).contiguous(),
        max_decode_ctx,
        prefill,
    )


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


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    k_param: torch.Tensor | None,
    v_param: torch.Tensor | None,
    static: torch.Tensor | None,
) -> int:
    """The KV_MODE of a call the kernels take (paged_attention_kernels: 0 float, 1 static int8, 2 online int8)."""
    int8 = k.dtype == torch.int8
    reason = unsupported_reason(q, q.dtype if int8 else k.dtype)
    if reason is not None:
        raise ValueError(f"paged_attention_triton: unsupported {reason}")
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} should be [blocks, block_size, Hkv, D] alike")
    if q.dim() != 3 or q.shape[0] != meta.num_tokens or q.shape[2] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} should be [{meta.num_tokens} tokens, heads, {k.shape[3]}]")
    if q.shape[1] % k.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[2]} KV heads")
    if q.stride(2) != 1 or k.stride() != v.stride() or k.stride(3) != 1:
        raise ValueError("q, k and v need a contiguous head dim, and k and v the same strides")
    if q.device != k.device:
        raise ValueError(f"q on {q.device} but the cache on {k.device}")
    if static is not None:
        if not int8 or k_param is not None or v_param is not None:
            raise ValueError("a static int8 table goes with int8 K/V codes and no online params")
        if static.shape != (4, *k.shape[2:]) or static.dtype != torch.float32 or not static.is_contiguous():
            raise ValueError(f"static int8 params {tuple(static.shape)} need a contiguous fp32 [4, Hkv, D] table")
        return 1
    if k_param is None or v_param is None:
        if int8 or k_param is not None or v_param is not None:
            raise ValueError("int8 K/V codes need k_param and v_param (online) or static; float K/V neither")
        return 0
    kp, vp = k_param, v_param
    layout = kp.shape == vp.shape == (*k.shape[:3], 2) and kp.stride() == vp.stride() and kp.stride(3) == 1
    if not (int8 and layout and kp.dtype == vp.dtype == torch.float16):
        raise ValueError("online int8 params need fp16 [blocks, block, Hkv, 2] with equal strides, beside int8 codes")
    return 2


def paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    *,
    k_param: torch.Tensor | None = None,
    v_param: torch.Tensor | None = None,
    static: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] over one layer's pools k, v (module docstring) -> out [T, Hq, D] in q's dtype."""
    kv_mode = _check(q, k, v, meta, k_param, v_param, static)
    cfg = config or default_config(q.shape[2], q.dtype)
    t, num_heads, d = q.shape
    out = torch.empty((t, num_heads, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    kv_heads = k.shape[2]
    group = num_heads // kv_heads
    g_pad = triton.next_power_of_2(group)
    # the kernel takes every pointer in every mode; the ones its KV_MODE does not read are k's
    kp, vp = (k_param, v_param) if kv_mode == 2 else (k, v)
    table = static if kv_mode == 1 else k
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
    pdl = pdl_options(q.device)

    def launch(
        tiles: torch.Tensor,
        part: torch.Tensor,
        part_ml: torch.Tensor,
        g_rows: int,
        block_m: int,
        splits: int,
        blocks: tuple[int, int, int],  # block_n, warps, stages
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
            table,
            meta.tables,
            meta.seq_info,
            tiles,
            scale * LOG2E,
            kv_heads,
            *strides,
            GROUP=group,
            G_ROWS=g_rows,
            BLOCK_M=block_m,
            BLOCK_N=blocks[0],
            HEAD_DIM=d,
            BLOCK_SIZE=k.shape[1],
            KV_MODE=kv_mode,
            SPLITS=splits,
            DOT_PRECISION=dot_precision,
            num_warps=blocks[1],
            num_stages=blocks[2],
            **pdl,
        )

    if meta.prefill:
        block_m = max(cfg.block_m, g_pad, 16)
        launch(meta.prefill_tiles(block_m // g_pad), out, out, g_pad, block_m, 1,
               (cfg.block_n, cfg.prefill_warps, cfg.num_stages))
    num_decode = meta.decode_tiles.shape[0]
    if not num_decode:
        return out
    programs = num_decode * kv_heads
    splits = decode_splits(programs, meta.max_decode_ctx, cfg, q.device)
    wide = kv_mode == 0 and programs >= WIDE_PROGRAMS_PER_SM * _sm_count(q.device)
    mha = cfg.mha_decode if wide and group == 1 else None
    if splits == 1:
        part = part_ml = out
    else:
        part = torch.empty((num_decode, num_heads, splits, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_decode, num_heads, splits, 2), dtype=torch.float32, device=q.device)
    if mha:
        _launch_mha(q, out, part, part_ml, k, v, meta, scale, splits, mha, strides[:8])
    else:
        rows = max(16, g_pad)
        blocks = (cfg.block_n, cfg.decode_warps, cfg.num_stages)
        if splits == 1 and cfg.wide_decode and wide:  # float KV only: int8 KV's best configs differ
            blocks = cfg.wide_decode
        launch(meta.decode_tiles, part, part_ml, rows, rows, splits, blocks)
    if splits > 1:
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
            **pdl,
        )
    return out


def _launch_mha(
    q: torch.Tensor,
    out: torch.Tensor,
    part: torch.Tensor,
    part_ml: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    splits: int,
    blocks: tuple[int, int, int],
    strides: tuple[int, ...],  # q's token and head, out's token and head, the tables', k's block, token and head
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # cos, sin, slots
) -> None:
    """The CUDA-core decode kernel (paged_decode_kernel) over meta's decode tiles; with rope, q is the fused
    projection and the kernel rotates it and stores the new keys and values first."""
    cos, sin, slots = rope if rope is not None else (q, q, meta.seq_info)
    _decode_mha_kernel[(meta.decode_tiles.shape[0], k.shape[2], splits)](
        q,
        out,
        part,
        part_ml,
        k,
        v,
        meta.tables,
        meta.seq_info,
        meta.decode_tiles,
        cos,
        sin,
        slots,
        scale * LOG2E,
        cos.stride(0),
        *strides,
        BLOCK_N=blocks[0],
        HEAD_DIM=k.shape[3],
        BLOCK_SIZE=k.shape[1],
        SPLITS=splits,
        ROPE=rope is not None,
        ROT=cos.shape[-1] if rope is not None else 2,
        num_warps=blocks[1],
        num_stages=blocks[2],
        **pdl_options(q.device),
    )


def rope_decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    num_heads: int,
    config: AttentionConfig | None = None,
) -> torch.Tensor | None:
    """RoPE, the KV write and decode attention in one launch, for a batch of decodes only with one query head per KV
    head on a float cache, wide enough for the CUDA-core kernel: qkv [T, 3 H D] (rows contiguous), cos/sin [T, rot],
    slots [T] int64 (the new tokens' cache slots), k/v one layer's pools -> out [T, H, D], the new keys and values
    stored as `rotary_qkv_triton` stores them. None where the batch does not qualify: the caller runs the rotary
    kernel and `paged_attention_triton` (the same values, up to the order of one softmax sum)."""
    t = qkv.shape[0]
    d = k.shape[-1] if k.dim() == 4 else 0
    if not (t and meta.num_tokens == t == meta.decode_tiles.shape[0] and not meta.prefill):
        return None
    if k.dim() != 4 or k.shape[2] != num_heads or qkv.shape[1] != 3 * num_heads * d or qkv.stride(1) != 1:
        return None
    q = qkv.view(t, 3 * num_heads, d)[:, :num_heads]
    rot = cos.shape[-1]
    if unsupported_reason(q, k.dtype) or k.dtype != v.dtype or k.stride() != v.stride() or k.stride(3) != 1:
        return None
    if rot % 2 or rot > d or not cos.is_contiguous() or sin.stride() != cos.stride() or slots.shape != (t,):
        return None
    cfg = config or default_config(d, qkv.dtype)
    programs = t * num_heads
    if not cfg.mha_decode or programs < WIDE_PROGRAMS_PER_SM * _sm_count(qkv.device):
        return None
    if decode_splits(programs, meta.max_decode_ctx, cfg, qkv.device) != 1:
        return None
    out = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    strides = (qkv.stride(0), d, out.stride(0), out.stride(1), meta.tables.stride(0), *k.stride()[:3])
    _launch_mha(qkv, out, out, out, k, v, meta, scale, 1, cfg.mha_decode, strides, (cos, sin, slots))
    return out
