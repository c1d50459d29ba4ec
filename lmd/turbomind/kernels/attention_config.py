"""Launch shapes of the paged-attention kernels: block configs per head dim and dtype, which kernels take a query,
how far a decode's context is split, and when a decode launch is wide enough for its wide configs (the dot kernel's
`wide_decode`, the CUDA-core MHA kernel). Shared by the dispatch (`paged_attention`) and the MHA decode's own entry
point (`paged_decode`)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton

from lmd.errors import LmdError

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
    # (block_n, warps, stages) of a decode launch (float or int8 KV) of at least WIDE_PROGRAMS_PER_SM programs per SM
    # with one query head per KV head, on the CUDA-core kernel (`paged_decode_kernel`); None: the dot kernel. Its
    # loads are not pipelined, so it needs many programs: at batch 64 (float KV) it is 8 % faster than the dot
    # kernel's wide config, at batch 16 up to 40 % slower (docs/benchmarks.md, twentieth session)
    mha_decode: tuple[int, int, int] | None = None
    # mha_decode on int8 codes (None: mha_decode's). A step of BLOCK_N keys moves half the bytes of a float one,
    # and the kernel's loads are not pipelined, so a program's steps take about as long either way: more keys a
    # step is the lever. LMD_MHA_DECODE_INT8="block_n,warps,stages" replaces it (benchmarks compare them)
    mha_decode_int8: tuple[int, int, int] | None = None
    # (block_n, warps, stages) of the one launch of RoPE, the KV write and the CUDA-core decode (`rope_decode_attention`)
    # for an MHA decode batch narrower than WIDE_PROGRAMS_PER_SM programs per SM (batch 1-32 on an H100), split over
    # the context as the dot kernel would be; None: the rotary kernel, then the dot kernel. It saves the rotary
    # launch a layer but loses more in the attention: the int4 batch-1 step on an H100 took 2.280-2.459 ms with it
    # (four shapes) against 2.233 without (docs/benchmarks.md, twenty-ninth session), so it is off by default;
    # LMD_MHA_DECODE_NARROW="block_n,warps,stages" sets it
    mha_decode_narrow: tuple[int, int, int] | None = None


WIDE_PROGRAMS_PER_SM = 8
# mha_decode: 32 keys a step on 1 warp is 126 registers for head dim 128 (Triton 3.6, sm_90a): 16 programs an SM, so
# batch 64 x 32 heads fits one wave, where the dot kernel's wide config (220 registers) took 1.72.
# mha_decode_int8: 128 keys a step on 4 warps. The int4 1000 real-length requests on an H100 with int8 KV, one run a
# shape (float KV 8,240-8,271 out tok/s in the same runs): 32,1,1 8,145 (last session), 64,1,1 7,746, 64,2,1 8,301,
# 64,4,1 8,121, 128,2,1 7,414, 128,4,1 8,410 (median decode step 7.86 ms against float's 8.91), 128,8,1 5,644,
# 256,8,1 6,956 (docs/benchmarks.md, twenty-ninth session)
DEFAULT_CONFIG = AttentionConfig(wide_decode=(32, 1, 2), mha_decode=(32, 1, 1), mha_decode_int8=(128, 4, 1))


def default_config(head_dim: int, dtype: torch.dtype) -> AttentionConfig:
    """Block shapes that compile for sm_90 without register spills (ptxas through Triton 3.6) for fp16/bf16 up to
    head dim 256; fp32 (IEEE dots on FMA units) is a correctness path and spills a little at head dim 128."""
    if dtype == torch.float32:
        return AttentionConfig(block_m=32, block_n=32)
    if head_dim > 128:
        return AttentionConfig(block_n=32)
    cfg = DEFAULT_CONFIG
    for field, env in (("mha_decode_int8", "LMD_MHA_DECODE_INT8"), ("mha_decode_narrow", "LMD_MHA_DECODE_NARROW")):
        override = _blocks_override(env, os.environ.get(env, ""))
        if override is not None:
            cfg = replace(cfg, **{field: override})
    return cfg


@functools.cache
def _blocks_override(env: str, value: str) -> tuple[int, int, int] | None:
    """(block_n, warps, stages) from an environment variable's "block_n,warps,stages"; None where it is unset."""
    if not value:
        return None
    try:
        block_n, warps, stages = (int(x) for x in value.split(","))
    except ValueError:
        raise LmdError(f"{env}={value!r}: expected block_n,warps,stages, e.g. 64,1,1") from None
    if block_n < 1 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8) or stages < 1:
        raise LmdError(f"{env}={value!r}: block_n a power of two, warps 1, 2, 4 or 8, stages >= 1")
    return block_n, warps, stages


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


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def decode_splits(programs: int, max_ctx: int, cfg: AttentionConfig, device: torch.device) -> int:
    """Split the context until about two programs run per SM, keeping at least 4 key steps per split."""
    if cfg.num_splits:
        return cfg.num_splits
    steps = triton.cdiv(max_ctx, cfg.block_n)
    splits = 1
    while programs * splits < 2 * sm_count(device) and steps >= 8 * splits and splits < 64:
        splits *= 2
    return splits


def wide_decode_launch(programs: int, float_kv: bool, device: torch.device) -> bool:
    """A float-KV decode launch of at least WIDE_PROGRAMS_PER_SM programs per SM: where the dot kernel's
    `wide_decode` applies (int8 KV's best configs differ, docs/benchmarks.md)."""
    return float_kv and programs >= WIDE_PROGRAMS_PER_SM * sm_count(device)


def mha_decode_blocks(programs: int, group: int, int8: bool, cfg: AttentionConfig,
                      device: torch.device) -> tuple[int, int, int] | None:
    """(block_n, warps, stages) of the CUDA-core MHA decode kernel for a launch of `programs` (sequence, KV head)
    pairs with `group` query heads per KV head on a float or int8 cache, or None: the dot kernel."""
    if group != 1 or not cfg.mha_decode or programs < WIDE_PROGRAMS_PER_SM * sm_count(device):
        return None
    return (cfg.mha_decode_int8 or cfg.mha_decode) if int8 else cfg.mha_decode


def mha_rope_blocks(programs: int, int8: bool, cfg: AttentionConfig,
                    device: torch.device) -> tuple[int, int, int] | None:
    """(block_n, warps, stages) of `rope_decode_attention`'s one launch for an MHA decode batch of `programs`
    (sequence, head) pairs, or None: the rotary kernel and the dispatch. Wide launches take `mha_decode_blocks`'
    shape, narrower ones `mha_decode_narrow` where it is set (split over the context as the dot kernel would be)."""
    if programs >= WIDE_PROGRAMS_PER_SM * sm_count(device):
        return mha_decode_blocks(programs, 1, int8, cfg, device)
    return cfg.mha_decode_narrow
