"""W4A16 GEMM for 16 token rows and more on the tensor cores' warp-level MMA (`mma.sync.m16n8k16`), in CUDA C++.

The GEMV kernel (`w4a16_mma_gemv`) streams weights with each warp on its own groups and every warp reading x from
global memory: right for a few token rows, where the weights are the traffic. From a few dozen rows on, x is as much
traffic as the weights and every weight fragment should feed many MMAs, so this kernel is a tiled GEMM: a CTA takes
a block of BN output channels (64 a warp) by BM token rows and runs the whole K range (or a K split), and a
cp.async pipeline of STAGES k tiles (64 deep) brings packed words, scales, zeros and x into shared memory while the
warps compute on an earlier tile. A warp holds 64 channels x 8 MB token rows of fp32 accumulators; per k32 step
it reads its A fragments (the 8 packed words of the GEMV's fragment plan, drawn in `w4a16_mma_gemv`) with two
16-byte shared loads, dequantizes them in registers as the GEMV's 32-row kernel does (w = (v - offset) * C s + z,
two packed ops a register), and each A fragment feeds MB MMAs. x reaches the B fragments through one 16-byte shared
load and two PRMTs per n8 block and k32 step (the fragment's k order is the nibbles', which ldmatrix cannot give).

Shared memory of one stage (k tile kt, 64 input channels), 16-byte chunks swizzled so that every 16-byte load of a
warp is free of bank conflicts (the phases of 8 lanes each touch 8 different chunks of a 128-byte line):

    words  [8 rows][BN] u32   qweight[8 kt + r, n0 ..]   chunk c of row r at c ^ 2 (r & 3)
    x      [BM rows][64] half x[m0 + m, 64 kt ..]        chunk c of row m at c ^ 4 (m & 1); rows past M zero-filled
    scales [SROWS][BN] half, zeros [SROWS][BN] half      the groups of the tile's two k32 steps (SROWS = 2 at group 32)

The weights' copies of the first STAGES - 1 tiles are issued before the PDL wait (nothing an earlier kernel writes),
x's after it. Split-K adds fp32 partials into the self-cleaning workspace of `w4a16_epilogue`, as the other kernels
do. Rows past BM run as token tiles, the grid's fastest axis, so the tiles of one weight block run side by side.

The PyTorch twin and CPU oracle is `mma_gemm_reference` (the same decode bits and dequant rounding); CI runs a
lane-level emulation of the source (tests/turbomind/kernels/mma_gemm_lanes.py) that also checks the swizzles for
bank conflicts, and compiles it for sm_90.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from lmd.turbomind.kernels import nvrtc
from lmd.turbomind.kernels.w4a16_mma_gemv import (
    FRAGMENT,
    GROUPS,
    PIPELINE,
    checked_operands,
    launch_w4a16,
    unit_values,
)

BLOCK_K = 64  # k of one pipeline stage
WARP_MS = (16, 32, 64)  # token rows a warp covers (n8 MMA blocks of 2, 4, 8)
MIN_ROWS = 16  # below this the GEMV kernel's folding blocks read less
# sm_90's 227 KiB of shared memory a block (static + dynamic), less a margin for the kernel's static part (the
# mbarriers, the split-K flag, the alignment of the dynamic part: up to 2 KiB)
SHARED_LIMIT = 223 * 1024


@dataclass(frozen=True)
class MmaGemmConfig:
    warps_n: int = 2  # warps along output channels (1, 2, 4), 64 channels each: block_n = 64 warps_n
    warps_m: int = 2  # warps along token rows (1, 2, 4, 8): block_m = warps_m warp_m
    warp_m: int = 32  # token rows a warp covers: 16, 32 or 64
    stages: int = 3  # k tiles in flight in the cp.async pipeline (2-6)
    split: int = 1  # K splits asked for (CTAs of one output tile adding into the split-K workspace)
    word_decode: bool = True  # fp16: one shift per packed word (bf16 always per pair)

    def __post_init__(self) -> None:
        if (self.warp_m not in WARP_MS or self.warps_n not in (1, 2, 4) or self.warps_m not in (1, 2, 4, 8)
                or self.warps_n * self.warps_m > 8 or not 2 <= self.stages <= 6 or self.split < 1):
            raise ValueError(f"mma-gemm config: warp_m one of {WARP_MS}, 1/2/4 warps along N, 1/2/4/8 along M, "
                             f"at most 8 in all, 2-6 stages, split >= 1; got {self}")

    @property
    def block_n(self) -> int:
        return 64 * self.warps_n

    @property
    def block_m(self) -> int:
        return self.warps_m * self.warp_m

    def name(self) -> str:
        return (f"mma-gemm n{self.block_n} m{self.block_m} w{self.warps_n}x{self.warps_m} s{self.stages} "
                f"k{self.split}{'' if self.word_decode else ' pair'}")


def shared_bytes(cfg: MmaGemmConfig, group: int) -> int:
    """Dynamic shared memory of a launch: STAGES stages of words, x, scales and zeros (see the module docstring)."""
    scale_rows = BLOCK_K // group if group < BLOCK_K else 1
    return cfg.stages * (8 * cfg.block_n * 4 + cfg.block_m * BLOCK_K * 2 + 2 * scale_rows * cfg.block_n * 2)


def supports(cfg: MmaGemmConfig, n: int, k: int, group: int) -> bool:
    return (n % cfg.block_n == 0 and k % BLOCK_K == 0 and group in GROUPS and k % group == 0
            and shared_bytes(cfg, group) <= SHARED_LIMIT)


def launch_shape(cfg: MmaGemmConfig, m: int, n: int, k: int) -> tuple[tuple[int, int, int], int]:
    """((token tiles, channel blocks, K splits), k tiles per split): the split asked for, every split non-empty."""
    k_tiles = k // BLOCK_K
    per_split = -(-k_tiles // min(cfg.split, k_tiles))
    return (-(-m // cfg.block_m), n // cfg.block_n, -(-k_tiles // per_split)), per_split


# (warps_n, warps_m, warp_m): CTA tiles from 128 x 16 to 128 x 256 channels x rows
TILES = ((2, 1, 16), (2, 1, 32), (4, 1, 32), (1, 2, 32), (2, 2, 32), (2, 1, 64), (4, 1, 64), (2, 2, 64),
         (1, 4, 32), (2, 4, 32), (4, 2, 64), (2, 4, 64))


def tuner_configs(bucket: int, n: int, k: int, group: int, sms: int) -> list[MmaGemmConfig]:
    """The configs the tuner times for one bucket of at least MIN_ROWS rows: CTA tiles no taller than the bucket,
    2-4 stages, unsplit and with the smallest power-of-two split that puts two CTAs on every SM."""
    if bucket < MIN_ROWS:
        return []
    out = []
    for warps_n, warps_m, warp_m in TILES:
        if warps_m * warp_m > bucket:
            continue
        tiles = -(-bucket // (warps_m * warp_m)) * (n // (64 * warps_n))
        split = 1
        while tiles * split < 2 * sms and (k // BLOCK_K) // (2 * split) >= 4:
            split *= 2
        for stages in (3, 4):
            for s in dict.fromkeys((1, split)):
                cfg = MmaGemmConfig(warps_n, warps_m, warp_m, stages, s)
                if supports(cfg, n, k, group):
                    out.append(cfg)
    return out


SOURCE = Path(__file__).with_suffix(".cu").read_text()


def kernel_source(dtype: torch.dtype, group: int, cfg: MmaGemmConfig, pdl: bool = False) -> str:
    defines = {"BF16": int(dtype == torch.bfloat16), "WARPS_N": cfg.warps_n, "WARPS_M": cfg.warps_m,
               "MB": cfg.warp_m // 8, "STAGES": cfg.stages, "GROUP": group,
               "WORD_DECODE": int(cfg.word_decode and dtype == torch.float16), "PDL": int(pdl)}
    return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + FRAGMENT + PIPELINE + SOURCE


@functools.cache
def _kernel(dtype: torch.dtype, group: int, cfg: MmaGemmConfig, pdl: bool, device: int) -> nvrtc.Kernel:
    return nvrtc.compile_kernel(kernel_source(dtype, group, cfg, pdl), "w4a16_mma_gemm", device)


def mma_gemm(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             bias: torch.Tensor | None, cfg: MmaGemmConfig) -> torch.Tensor:
    """x2d [M, K] -> [M, N] in x's dtype, on CUDA."""
    m, k = x2d.shape
    n = qweight.shape[1]
    group = k // scales.shape[0]
    if not supports(cfg, n, k, group):
        raise ValueError(f"mma-gemm {cfg.name()} needs N % {cfg.block_n} == 0, K % {BLOCK_K} == 0, a group of "
                         f"{GROUPS} and at most {SHARED_LIMIT} bytes of shared memory; got N={n}, K={k}, "
                         f"group={group}")
    x2d, bias = checked_operands("mma-gemm", x2d, qweight, scales, zeros, bias)
    grid, per_split = launch_shape(cfg, m, n, k)
    return launch_w4a16(lambda pdl, device: _kernel(x2d.dtype, group, cfg, pdl, device), x2d, qweight, scales, zeros,
                        bias, grid, [per_split], grid[0] * grid[1] if grid[2] > 1 else 0,
                        32 * cfg.warps_n * cfg.warps_m, shared_bytes(cfg, group))


def mma_gemm_reference(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       word_decode: bool = True) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch: each weight decoded to offset + c / C from the same bits, dequantized as
    (v - offset) * (C s) + z rounded once to x's dtype, then an fp32 matmul. x2d [M, K] -> [M, N]."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = k // scales.shape[0]
    word = word_decode and x2d.dtype == torch.float16
    values, offsets = unit_values(qweight, x2d.dtype, word)
    codes_over_c = (values - offsets).permute(0, 2, 1).reshape(k, n).double()  # row 8r + i: nibble i of row r
    c = 64.0 if word else 16.0
    scale_c = (c * scales.double()).to(x2d.dtype).double().repeat_interleave(group, dim=0)
    w = (codes_over_c * scale_c + zeros.double().repeat_interleave(group, dim=0)).to(x2d.dtype)
    return (x2d.float() @ w.float()).to(x2d.dtype)
