"""W4A16 GEMM on Hopper's warpgroup MMA (`wgmma.mma_async`, sm_90a) with the int4 decode overlapped, for 64 token
rows and more, in CUDA C++ (NVRTC).

From a few hundred rows on a W4A16 GEMM is bound by the tensor cores, and on Hopper only wgmma reaches their rate
(`mma.sync`, the other kernels' MMA, stays well below it); the int4 decode must then run beside the MMAs, not in
front of them. A CTA of 384 threads works on output tiles of BN channels (128 or 256) by BT token rows (64, 128
or 256), in k tiles of 64 through STAGES shared-memory stages:

    warpgroup 0 (producer)   thread 0, PREFETCH tiles ahead (STAGES - 1 under RS, else STAGES - 2): arrive.expect_tx
                             of the stage's bytes on full[s], then TMA copies of the packed words [8][BN], scales and
                             zeros (bulk) and x [BT][64] (a tensor-map box, rows past M as zeros). SS only: the
                             warpgroup then waits full[i % STAGES], dequantizes tile i's words into the stage's A
                             tile ((v - offset) C s + z, the other kernels' bits and rounding; 8 halves in k order per
                             word), fences the async proxy and arrives on ready[i % STAGES]
    warpgroups 1, 2          wait ready[s] (full[s] under RS, which decodes its A fragments itself); 4 k16 steps of
    (consumers)              wgmma m64nBTk16 per 64-channel slice; commit; once tile i - 1's group is done, arrive
                             on empty[(i-1) % S]

The producer refills a stage only after empty says both consumers' reads of its previous tile are over; SS
dequantizes tile i while the consumers' wgmma of tile i - 1 runs. Work is scheduled stream-K: the grid's G CTAs split
the tile-major sequence of (output tile, k tile) iterations evenly, so no wave is ragged however the tiles fall on the
SMs (the N = 4096 shapes, or 172 tiles on 132 SMs); the pipeline runs on across tile boundaries. A tile one CTA covers
whole leaves straight from the accumulators; the CTAs that share one each store their fp32 partial in register order
to a slot of their own (two a CTA: a CTA shares at most its first and its last tile) and bump the tile's counter, and
the last to bump adds the others' partials and writes the tile (no atomics on the data: the atomic adds into one slot,
and the reads that cleaned it, had made stream-K slower than one CTA a tile). `split` sets G: one CTA a tile (1), that
many a tile (2, 3, ...), or as many as the SMs hold at once (0, "stream").

x sits in the 128-byte swizzle, K-major: token m's 64 k are one 128-byte row, its 16-byte chunk c at c ^ (m % 8), in
1024-byte atoms of 8 rows, as a TMA box of a tensor map in that swizzle lands (`x_tensor_map`, encoded on the host
each launch; rows past M land as zeros), and wgmma reads it through a swizzled descriptor. The words, scales and zeros
come by bulk copies, one a row. One producer thread issues a stage's copies (about a dozen instructions), which
complete as bytes on its full mbarrier. (Copied by 128 threads with cp.async, 16 bytes each, the unswizzled x sent
each L2 sector twice, and the producer's address arithmetic, ~240 instructions a k tile a warp, left the consumers
waiting for stages: ncu, twenty-fifth session.) A sits in wgmma's canonical K-major layout without swizzle: 8 x 8 core
matrices of 128 contiguous bytes, core (row / 8, k / 8) at (row / 8) 1024 + (k / 8) 128, so a dequantized word is one
16-byte row of a core matrix. Accumulators: BT / 2 fp32 a thread per slice (a consumer holds BN / 128 slices);
setmaxnreg gives the consumers most of the registers.

The PyTorch twin is the mma.sync GEMM's (`mma_gemm_reference`: the same decode and dequant rounding); CI runs a
lane-level emulation (tests/turbomind/kernels/wgmma_lanes.py: copies, decode and stores at their shared addresses,
the descriptors read through the canonical and swizzled layouts, the register layout of D, the stream-K segments,
the partial slots and the counters left at zero), runs its barrier protocol as a model under random schedules
(test_wgmma_pipeline_protocol.py) and compiles it for sm_90a.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lmd.turbomind.kernels import nvrtc
from lmd.turbomind.kernels.w4a16_mma_gemv import FRAGMENT, GROUPS, PIPELINE, checked_operands, launch_w4a16

BLOCK_K = 64
THREADS = 384
MIN_ROWS = 64  # below this the producer's decode outruns the MMAs it feeds: the mma.sync kernels win
DEFAULT_MIN_ROWS = 256  # offered by default from here, RS only: where the GPU measured it level with the plans
# sm_90's 227 KiB of shared memory a block (static + dynamic), less a margin for the kernel's static part (the
# mbarriers, the split-K flag, the alignment of the dynamic part: up to 2 KiB)
SHARED_LIMIT = 223 * 1024
MAX_ACCUMULATORS = 128  # fp32 accumulators a consumer thread holds (BN / 128 slices x BT / 2)


@dataclass(frozen=True)
class WgmmaConfig:
    block_n: int = 128  # output channels of a CTA: 128 or 256 (64-channel slices, half to each consumer)
    block_t: int = 128  # token rows of a CTA: 64, 128 or 256 (the wgmma's n)
    stages: int = 4  # shared-memory stages (3-8): stages - 1 (RS) or - 2 tiles of copies in flight
    split: int = 1  # CTAs a tile (1, 2, ...) or 0: stream-K over as many CTAs as the SMs hold at once
    word_decode: bool = True  # fp16: one shift per packed word (bf16 always per pair); RS has its own decode
    rs: bool = False  # A from registers: the consumers dequantize their fragments, no A tile in shared memory
    depth: int = 1  # RS: k16 steps' wgmma groups a consumer keeps in flight (1 or 3; register sets: depth + 1)

    def __post_init__(self) -> None:
        if (self.block_n not in (128, 256) or self.block_t not in (64, 128, 256) or not 3 <= self.stages <= 8
                or self.split < 0 or self.block_n // 128 * self.block_t // 2 > MAX_ACCUMULATORS
                or (self.rs and not self.word_decode) or self.depth not in (1, 3) or (self.depth > 1 and not self.rs)):
            raise ValueError(f"wgmma config: block_n 128/256, block_t 64/128/256 with at most {MAX_ACCUMULATORS} "
                             f"accumulators a thread, 3-8 stages, split >= 0, no pair decode under RS (it decodes "
                             f"its own way), depth 1 or 3 (RS only); got {self}")

    def name(self) -> str:
        return (f"wgmma n{self.block_n} t{self.block_t} s{self.stages} {f'k{self.split}' if self.split else 'stream'}"
                f"{'' if self.word_decode else ' pair'}{' rs' if self.rs else ''}"
                f"{f' d{self.depth}' if self.depth > 1 else ''}")


SWIZZLE_ATOM = 1024  # 8 rows of 128 bytes: the 128-byte swizzle's pattern, which x's tile must start on


def stage_layout(cfg: WgmmaConfig, group: int) -> dict[str, int]:
    """Byte offsets within one k tile's stage and its size, the .cu's defines: x [BT][64] in the 128-byte swizzle
    first, then the dequantized A tile (not under RS), the raw words [8][BN] u32, the scales and the zeros
    [SROWS][BN] each; the size in whole swizzle atoms, so that every stage's x starts on one."""
    scale_rows = BLOCK_K // group if group < BLOCK_K else 1
    a_offset = cfg.block_t * BLOCK_K * 2
    raw_offset = a_offset + (0 if cfg.rs else cfg.block_n * BLOCK_K * 2)
    sc_offset = raw_offset + 8 * cfg.block_n * 4
    sc_bytes = scale_rows * cfg.block_n * 2
    size = -(-(sc_offset + 2 * sc_bytes) // SWIZZLE_ATOM) * SWIZZLE_ATOM
    return {"X_OFFSET": 0, "A_OFFSET": a_offset, "RAW_OFFSET": raw_offset, "SC_OFFSET": sc_offset,
            "SC_BYTES": sc_bytes, "STAGE_BYTES": size}


def stage_bytes(cfg: WgmmaConfig, group: int) -> int:
    return stage_layout(cfg, group)["STAGE_BYTES"]


def shared_bytes(cfg: WgmmaConfig, group: int) -> int:
    """Dynamic shared memory: the stages."""
    return cfg.stages * stage_bytes(cfg, group)


def supports(cfg: WgmmaConfig, n: int, k: int, group: int) -> bool:
    return (n % cfg.block_n == 0 and k % BLOCK_K == 0 and group in GROUPS and k % group == 0
            and shared_bytes(cfg, group) <= SHARED_LIMIT)


def runs_on(device: torch.device) -> bool:
    """An sm_90 device (wgmma, setmaxnreg and the TMA unit are sm_90a's). The tuner offers the kernel there unless
    `LMD_W4A16_CUDA=0` (`offered_configs`, `w4a16_mma_gemv.cuda_kernels`)."""
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) == (9, 0))


def iterations(cfg: WgmmaConfig, m: int, n: int, k: int) -> tuple[int, int]:
    """(output tiles, (tile, k tile) iterations) of a launch."""
    tiles = -(-m // cfg.block_t) * (n // cfg.block_n)
    return tiles, tiles * (k // BLOCK_K)


def grid_size(cfg: WgmmaConfig, m: int, n: int, k: int, resident: int) -> int:
    """G, the CTAs of a launch: `split` a tile, or (split 0) `resident` (the SMs times the CTAs one holds), never more
    than there are iterations."""
    tiles, total = iterations(cfg, m, n, k)
    return min(total, tiles * cfg.split if cfg.split else resident)


TILES = ((128, 64), (128, 128), (256, 64), (256, 128), (128, 256))  # (block_n, block_t)
# 128 x 64 with 3 stages: 86 KiB and 32 accumulators a consumer thread, so two CTAs share an SM (built for it:
# `ctas_per_sm`), two producers decoding for one tensor core
TWO_A_SM = (128, 64)


def ctas_per_sm(cfg: WgmmaConfig, group: int) -> int:
    """CTAs an SM holds at once, as the kernel is built (its launch bounds and register split): 2 for the small tile
    where its shared memory allows, else 1."""
    return 2 if (cfg.block_n, cfg.block_t) == TWO_A_SM and 2 * shared_bytes(cfg, group) <= SHARED_LIMIT else 1


def tuner_configs(bucket: int, n: int, k: int, group: int) -> list[WgmmaConfig]:
    """The configs the tuner times for a bucket of at least MIN_ROWS rows: tiles no taller than the bucket, the
    deepest pipeline that fits (and 4 stages beside 6; 3 for the tile two CTAs an SM can share), one CTA a tile and
    stream-K; and the RS form of each tile at its deepest pipeline, keeping 1 or 3 k16 steps in flight."""
    if bucket < MIN_ROWS:
        return []
    out = []
    for block_n, block_t in TILES:
        if block_t > bucket:
            continue
        fits = [s for s in range(3, 7) if supports(WgmmaConfig(block_n, block_t, s), n, k, group)]
        depths = fits[-1:] + ([4] if fits and fits[-1] >= 6 else [])  # the deepest, and 4 beside 6
        if (block_n, block_t) == TWO_A_SM:
            depths.append(3)
        out += [WgmmaConfig(block_n, block_t, stages, split) for stages in depths for split in (1, 0)]
        rs_fits = [s for s in range(3, 7) if supports(WgmmaConfig(block_n, block_t, s, rs=True), n, k, group)]
        out += [WgmmaConfig(block_n, block_t, stages, split, rs=True, depth=depth) for stages in rs_fits[-1:]
                for split in (1, 0) for depth in (1, 3)]
    return out


def offered_configs(bucket: int, n: int, k: int, group: int, every: bool) -> list[WgmmaConfig]:
    """What the tuner offers: every config (`LMD_W4A16_CUDA=1`), or by default the RS ones from DEFAULT_MIN_ROWS
    (on an H100 the SS form lost everywhere, and from 256 rows the RS form ties or beats the Triton plans and
    dequantize+cuBLAS: docs/benchmarks.md, twenty-fifth session). Depth 3 passes the GPU checks but was never more than
    1 % faster than depth 1 on an H100 (within noise; at worst 9 % slower: twenty-sixth session)."""
    configs = tuner_configs(bucket, n, k, group)
    return configs if every else [c for c in configs if c.rs and c.depth == 1 and bucket >= DEFAULT_MIN_ROWS]


SOURCE = Path(__file__).with_suffix(".cu").read_text()


def wgmma_tile_source(dtype: torch.dtype, block_t: int, rs: bool) -> str:
    """`wgmma_tile(d, a, b, accumulate)` (A from a shared-memory descriptor) or, under RS, `wgmma_tile_rs(d, a[4], b,
    accumulate)` (A from 4 registers a thread, in mma.sync's m16n8k16 A fragment layout for each warp's 16 rows): one
    wgmma.mma_async m64n<block_t>k16 with fp32 accumulators d[0 .. block_t / 2), B from a descriptor, K-major (no
    transpose); D = A B (+ D if accumulate: the scale-d predicate)."""
    n = block_t // 2
    kind = "bf16" if dtype == torch.bfloat16 else "f16"
    regs = ", ".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    if rs:  # operands after d: a[0..3], b, accumulate; no transpose immediate for a register A
        a_text = "{" + ", ".join(f"%{n + i}" for i in range(4)) + "}"
        name, a_param, a_inputs, tail = ("wgmma_tile_rs", "const u32* a",
                                         '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])', "1, 1, 0")
    else:  # a, b, accumulate
        name, a_param, a_text, a_inputs, tail = "wgmma_tile", "u64 a", f"%{n}", '"l"(a)', "1, 1, 0, 0"
    b = n + (4 if rs else 1)
    return (f"__device__ __forceinline__ void {name}(float* d, {a_param}, u64 b, int accumulate) {{\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{b + 1}, 0;\\n"\n'
            f'                 "wgmma.mma_async.sync.aligned.m64n{block_t}k16.f32.{kind}.{kind} {{{regs}}}, {a_text}, '
            f'%{b}, p, {tail};\\n}}\\n"\n'
            f'                 : {outs}\n'
            f'                 : {a_inputs}, "l"(b), "r"(accumulate));\n}}\n')


def kernel_source(dtype: torch.dtype, group: int, cfg: WgmmaConfig, pdl: bool = False) -> str:
    defines = {"BF16": int(dtype == torch.bfloat16), "WORD_DECODE": int(cfg.word_decode and dtype == torch.float16),
               "BN": cfg.block_n, "BT": cfg.block_t, "STAGES": cfg.stages, "GROUP": group, "PDL": int(pdl),
               "CTAS_PER_SM": ctas_per_sm(cfg, group), "RS": int(cfg.rs), "RS_DEPTH": cfg.depth,
               **stage_layout(cfg, group)}
    return ("".join(f"#define {k} {v}\n" for k, v in defines.items()) + FRAGMENT + PIPELINE
            + wgmma_tile_source(dtype, cfg.block_t, cfg.rs) + SOURCE)


@functools.cache
def _kernel(dtype: torch.dtype, group: int, cfg: WgmmaConfig, pdl: bool, device: int) -> nvrtc.Kernel:
    return nvrtc.compile_kernel(kernel_source(dtype, group, cfg, pdl), "w4a16_wgmma", device, arch_suffix="a")


def wgmma_gemm(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               bias: torch.Tensor | None, cfg: WgmmaConfig) -> torch.Tensor:
    """x2d [M, K] -> [M, N] in x's dtype, on an sm_90 CUDA device."""
    m, k = x2d.shape
    n = qweight.shape[1]
    group = k // scales.shape[0]
    if not supports(cfg, n, k, group):
        raise ValueError(f"wgmma {cfg.name()} needs N % {cfg.block_n} == 0, K % {BLOCK_K} == 0, a group of {GROUPS} "
                         f"and at most {SHARED_LIMIT} bytes of shared memory; got N={n}, K={k}, group={group}")
    x2d, bias = checked_operands("wgmma", x2d, qweight, scales, zeros, bias)
    if torch.cuda.get_device_capability(x2d.device) != (9, 0):
        raise ValueError("wgmma runs on sm_90 (Hopper) devices")
    return launch_with(lambda pdl, device: _kernel(x2d.dtype, group, cfg, pdl, device), x2d, qweight, scales, zeros,
                       bias, cfg)


def launch_with(kernel_for: Callable[[bool, int], nvrtc.Kernel], x2d: torch.Tensor, qweight: torch.Tensor,
                scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None, cfg: WgmmaConfig) -> torch.Tensor:
    """One launch of `kernel_for(pdl, device)` (this kernel's source, or a copy of it) as `wgmma_gemm` makes it, on
    checked operands: the grid, the tensor map of x, the counters and partial slots of shared tiles."""
    m, k = x2d.shape
    n = qweight.shape[1]
    group = k // scales.shape[0]
    sms = torch.cuda.get_device_properties(x2d.device).multi_processor_count
    tiles, _ = iterations(cfg, m, n, k)
    most = grid_size(cfg, m, n, k, sms * ctas_per_sm(cfg, group))  # resident CTAs never exceed the launch bounds

    def grid(kernel: nvrtc.Kernel) -> tuple[int, int, int]:
        resident = sms * max(1, nvrtc.max_active_blocks(kernel, THREADS, shared_bytes(cfg, group)))
        ctas = grid_size(cfg, m, n, k, resident)
        if ctas > most:  # the launch bounds cap residency: cannot happen while they say 1 or 2 CTAs an SM
            raise RuntimeError(f"wgmma {cfg.name()}: {ctas} CTAs but partial slots for {most}")
        return ctas, 1, 1

    # shared tiles (split != 1): a counter a tile, and two partial slots of block_t x block_n floats a CTA (the .cu;
    # 2 split M N floats for a fixed split, which the tuner does not offer), in the workspace of their own kind:
    # they are left as written, which the atomically-adding kernels' zeroed workspace must never be
    shared = cfg.split != 1
    return launch_w4a16(kernel_for, x2d, qweight, scales, zeros, bias, grid, [x_tensor_map(x2d, cfg)],
                        tiles if shared else 0, THREADS, shared_bytes(cfg, group),
                        2 * most * cfg.block_t * cfg.block_n if shared else 0, workspace_kind="partials")


def x_tensor_map(x2d: torch.Tensor, cfg: WgmmaConfig) -> bytes:
    """The kernel's x_map: boxes of block_t rows x one k tile (128 bytes) in the 128-byte swizzle, rows past M read
    as zeros."""
    return nvrtc.tensor_map_2d(x2d, cfg.block_t, BLOCK_K)
