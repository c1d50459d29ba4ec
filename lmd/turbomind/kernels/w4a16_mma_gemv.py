"""W4A16 for 1 to 128 token rows on the tensor cores' warp-level MMA (`mma.sync.m16n8k16`), in CUDA C++ (NVRTC).

y.T = W x.T, the dequantized weight as the MMA's A operand (16 output channels x 16 input channels, from registers),
the activations as B (16 input channels x 8 token rows; rows past M are zeros). At a few token rows the tensor cores
idle either way: what the kernel must do is stream the packed weights at memory speed with few instructions per
weight. It reads the engine layout as it is (no reorder): a thread loads two 16-byte vectors of one packed row,
and those 8 words are its whole A fragment for two k16 steps and four 16-channel tiles. Which input channel and
which output channel each fragment slot stands for is ours to choose (a sum over k does not care about order, and
the outputs are stored where they belong), so:

    lane = 4 g + t (g = 0..7, t = 0..3), a k32 step at k0, the warp's 64 output channels at c0:
    packed word e (0..7) of the thread = qweight[(k0 + 8 t) / 8, c0 + 4 g + ch(e)],  ch(e) = e (e < 4), 28 + e
    A tile j (0..3), row g      <- word 2 j        (output channel c0 + 4 g + ch(2 j))
                     row g + 8  <- word 2 j + 1    (output channel c0 + 4 g + ch(2 j + 1))
    k16 step h (0, 1): fragment columns (2t, 2t+1) <- nibbles (2h, 2h+4), columns (2t+8, 2t+9) <- (2h+1, 2h+5)
    B (the same columns) <- x[m, k0 + 8 t + nibble]: one 16-byte load of x[m, k0 + 8 t ..] and two PRMTs a step

The two runs of 4 channels (c0 + 4g .., c0 + 32 + 4g ..) make each 16-byte load of a warp read whole 128-byte rows:
with 8 consecutive channels a thread, two loads would each take half of every 32-byte sector, and with L1 bypassed
each sector would cross from L2 twice.

Decode: a nibble placed in a mantissa reads as offset + c / C exactly, no conversion. fp16 ("word decode"): one
shift per word; LOP3 (q & 0x000F000F) | 16.0 gives nibbles (0, 4) as 16 + c/64, (q & 0x00F000F0) | 1.0 gives
(1, 5) as 1 + c/64, and the same on q >> 8 for (2, 6) and (3, 7): 5 instructions per 8 weights. bf16 (7 mantissa
bits) and the "pair" configs: a shift per pair into 1 + c/16.

Up to 16 rows (`block_m` 8 or 16): no arithmetic per weight beyond the decode. The MMA sums d = sum_k x_k v_k per
group (fp32), one more MMA (A = the offsets in rows g, ones in rows g + 8) sums o = sum_k x_k offset_k and xs =
sum_k x_k, and each group folds once (scale s, folded zero z = -zero * s):

    sum_k x_k (c_k s + z) = C s (d - o) + z xs

At 32 rows a second accumulator set per group would not fit: the A fragment is dequantized in registers, w = (v -
offset) * C s + z (the subtraction exact, the FMA rounding once to the activation dtype, as the other kernels'
dequant does), and the MMA sums over all groups. More rows than `block_m` run as token tiles, the grid's fastest
axis, so the tiles of one weight block run side by side and all but the first find its words in L2.

Split-K as the Triton kernels do it (`w4a16_epilogue`): the warps of a CTA take different groups and meet in shared
memory; CTAs of a column block add fp32 partials into the self-cleaning workspace and the last one writes. With
PDL the first group's words, scales and zeros are loaded before the wait for the previous kernel, x after it.

A warp holds its group's words in registers (32 at g128), twice with the register double buffer `prefetch`; on the
H100 that made 178 registers a thread and one 256-thread CTA an SM, and ncu found the kernel bound by loads in flight
(docs/benchmarks.md, twenty-fourth session). The staged configs (`stages` 2-4) copy a warp's next groups into shared
memory by cp.async instead (each lane its own slots, so its cp.async.wait_group alone orders copy and read), with
STAGES groups in flight a warp and one in registers; the first STAGES copies go before the PDL wait. x is still
loaded at each group, after the wait for its weights.

The CPU path and the test oracle is `mma_gemv_reference` (the same decode bits and fold in PyTorch); CI also runs a
lane-level emulation of this source (tests/turbomind/kernels/mma_gemv_lanes.py) and compiles it for sm_90.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lmd.errors import LmdError
from lmd.turbomind.kernels import nvrtc

BLOCK_N = 64  # output channels per CTA (a warp's four 16-row A tiles)
GROUPS = (32, 64, 128)  # group sizes the kernel takes (a group is whole k32 steps, unrolled)
BLOCK_MS = (8, 16, 32)  # token rows per CTA: n8 MMA blocks of 1, 2, 4 (more rows: more token tiles in the grid)
STAGES = (0, 2, 3, 4)  # shared-memory stages a warp (0: none, loads into registers)


@dataclass(frozen=True)
class MmaGemvConfig:
    block_m: int = 8  # token rows a CTA covers: 8, 16 (one or two n8 MMA blocks, fold per group) or 32
    # (dequantized in registers); M past it runs as more token tiles
    warps: int = 4  # warps per CTA, each on its own groups of the CTA's K range
    groups_per_warp: int = 1  # K range of a CTA = warps * groups_per_warp groups (sets split-K)
    prefetch: bool = False  # load the warp's next group while computing this one (a register double buffer)
    word_decode: bool = True  # fp16: one shift per packed word, not one per nibble pair (bf16 always per pair)
    stages: int = 0  # 0: a warp loads its groups into registers; 2-4: that many groups in flight a warp, by cp.async
    # into shared memory (instead of the register double buffer `prefetch`)

    def __post_init__(self) -> None:
        if (self.block_m not in BLOCK_MS or not 1 <= self.warps <= 8 or self.groups_per_warp < 1
                or self.stages not in STAGES or (self.stages and self.prefetch)):
            raise ValueError(f"mma-gemv config: block_m one of {BLOCK_MS}, 1-8 warps, groups_per_warp >= 1, stages "
                             f"one of {STAGES} and not with prefetch; got {self}")

    def name(self) -> str:
        return (f"mma-gemv m{self.block_m} w{self.warps} g{self.groups_per_warp} pf{int(self.prefetch)}"
                f"{'' if self.word_decode else ' pair'}{f' st{self.stages}' if self.stages else ''}")

    def shared_bytes(self, group: int) -> int:
        """Dynamic shared memory of a launch: each warp's stages."""
        return self.warps * self.stages * stage_bytes(group)


def stage_bytes(group: int) -> int:
    """One stage of the staged configs (STAGE_BYTES in the .cu): a group's words, two 32-lane x 16-byte slots a k32
    step, then scales and zeros, four 32-lane x 8-byte slots."""
    return (group // 32) * 2 * 512 + 4 * 256


def supports(n: int, k: int, group: int) -> bool:
    return n % BLOCK_N == 0 and group in GROUPS and k % group == 0


def cuda_kernels(device: torch.device) -> str:
    """Which of lmd's CUDA C++ W4A16 kernels the tuner offers on `device`, from `LMD_W4A16_CUDA`:
    - unset: "default", this GEMV for buckets up to DEFAULT_ROWS, where the GPU measured it ahead of the Triton plans
      (1.07-1.9x at 1-8 rows on the Llama-7B shapes, 0.96-1.38x at 16; docs/benchmarks.md, twenty-third session),
      and on sm_90 the RS form of the wgmma GEMM from w4a16_wgmma.DEFAULT_MIN_ROWS (with TMA copies and stream-K it
      ties or beats the Triton plans there: 0.97-1.29x at 256 rows, 0.94-1.03x dequantize+cuBLAS at 1024;
      twenty-fifth session);
    - "1": "all", also this GEMV up to MAX_ROWS and its staged configs, the mma.sync GEMM and on sm_90 every wgmma
      config from 64 rows. They pass every check on the GPU; the rest are behind the Triton plans, there to be
      measured;
    - "0", a device that is not CUDA or is older than sm_80 (mma.sync m16n8k16 and cp.async), or no NVRTC: "none"."""
    setting = os.environ.get("LMD_W4A16_CUDA", "")
    if setting not in ("", "0", "1"):
        raise LmdError(f"LMD_W4A16_CUDA={setting!r}: 0 (none of the CUDA W4A16 kernels), 1 (all of them) or unset "
                       "(the mma.sync GEMV up to 16 rows, the wgmma GEMM from 256)")
    if (setting == "0" or device.type != "cuda" or not nvrtc.available()
            or torch.cuda.get_device_capability(device) < (8, 0)):
        return "none"
    return "all" if setting == "1" else "default"


MAX_ROWS = 128  # token tiles re-read the weights (from L2 at best): past 4 tiles the tensor-core GEMMs win
DEFAULT_ROWS = 16  # offered up to here by default: from 32 rows the Triton plans are ahead (cuda_kernels)


def launch_shape(cfg: MmaGemvConfig, m: int, n: int, k: int, group: int) -> tuple[int, int, int]:
    """The grid `mma_gemv` launches: (token tiles, 64-channel blocks, K splits)."""
    return -(-m // cfg.block_m), n // BLOCK_N, -(-(k // group) // (cfg.warps * cfg.groups_per_warp))


def tuner_configs(bucket: int, n: int, k: int, group: int, max_rows: int = MAX_ROWS,
                  staged: bool = False) -> list[MmaGemvConfig]:
    """The configs the tuner times for one bucket of up to max_rows (at most MAX_ROWS) rows; `staged`: also the
    cp.async-staged ones (a warp with 2-8 groups, 2-4 of them in flight)."""
    if bucket > min(max_rows, MAX_ROWS) or not supports(n, k, group):
        return []
    block_m = next((b for b in BLOCK_MS if b >= bucket), BLOCK_MS[-1])
    configs = [MmaGemvConfig(block_m, warps, per_warp, prefetch) for warps in (2, 4, 8) for per_warp in (1, 2, 4)
               for prefetch in (False, True) if not (prefetch and per_warp == 1)]
    if staged:
        configs += [MmaGemvConfig(block_m, warps, per_warp, stages=stages) for warps in (4, 8) for per_warp in (2, 4, 8)
                    for stages in STAGES[1:] if stages <= per_warp]
    return configs


FRAGMENT = Path(__file__).with_name("w4a16_mma_fragment.cuh").read_text()  # the decode and MMA helpers both kernels use
PIPELINE = Path(__file__).with_name("cuda_pipeline.cuh").read_text()  # cp.async and shared loads (the staged configs)
SOURCE = Path(__file__).with_suffix(".cu").read_text()


def word_decode(dtype: torch.dtype, cfg: MmaGemvConfig) -> bool:
    """bf16's 7-bit mantissa cannot hold a nibble at bits 4..7, so bf16 decodes per pair whatever the config says."""
    return cfg.word_decode and dtype == torch.float16


def kernel_source(dtype: torch.dtype, group: int, cfg: MmaGemvConfig, pdl: bool = False) -> str:
    defines = {"BF16": int(dtype == torch.bfloat16), "MB": cfg.block_m // 8, "GSTEPS": group // 32,
               "WARPS": cfg.warps, "PREFETCH": int(cfg.prefetch), "STAGES": cfg.stages,
               "STAGE_BYTES": stage_bytes(group), "WORD_DECODE": int(word_decode(dtype, cfg)), "PDL": int(pdl)}
    return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + FRAGMENT + PIPELINE + SOURCE


@functools.cache
def _kernel(dtype: torch.dtype, group: int, cfg: MmaGemvConfig, pdl: bool, device: int) -> nvrtc.Kernel:
    """The compiled kernel, loaded into `device`'s context (a module belongs to the context current at its load)."""
    return nvrtc.compile_kernel(kernel_source(dtype, group, cfg, pdl), "w4a16_mma_gemv", device)


def checked_operands(kind: str, x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x, bias) as the mma.sync kernels read them (contiguous, x 16-byte aligned: a view at an odd offset is copied);
    a one-line error for operands they cannot take."""
    if x2d.dtype not in (torch.float16, torch.bfloat16) or any(
            t is not None and t.dtype != x2d.dtype for t in (scales, zeros, bias)) or qweight.dtype != torch.int32:
        raise ValueError(f"{kind} takes fp16/bf16 x with scales, zeros and bias of x's dtype and int32 qweight")
    if not x2d.is_cuda:
        raise ValueError(f"{kind} runs on CUDA tensors")
    if any(t.data_ptr() % 16 or not t.is_contiguous() for t in (qweight, scales, zeros)):
        raise ValueError(f"{kind} reads qweight, scales and zeros as contiguous 16-byte vectors")
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    elif x2d.data_ptr() % 16:
        x2d = x2d.clone()
    return x2d, bias.contiguous() if bias is not None else None


def launch_w4a16(kernel_for: Callable[[bool, int], nvrtc.Kernel], x2d: torch.Tensor, qweight: torch.Tensor,
                 scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
                 grid: tuple[int, int, int] | Callable[[nvrtc.Kernel], tuple[int, int, int]], extra: list[int | bytes],
                 tiles: int, threads: int, shared_bytes: int = 0, workspace: int = 0,
                 workspace_kind: str = "zeroed") -> torch.Tensor:
    """One launch of a W4A16 CUDA kernel (the three share the parameters x, qweight, scales, zeros, bias, out, split-K
    workspace and counters, M, N, K, then their own `extra` (ints, or bytes such as a tensor map), then has_bias);
    `kernel_for(pdl, device)` builds or fetches it, `grid` may depend on it. `tiles`: the split-K counters the launch
    uses (0: it adds no partials), `workspace` the fp32 elements of its workspace (default M x N). Returns out [M, N]
    in x's dtype."""
    from lmd.turbomind.kernels.pdl import pdl_enabled  # both import Triton, which the tuner has by now
    from lmd.turbomind.kernels.w4a16_epilogue import SplitKWorkspace

    m, k = x2d.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    ws, cnt = SplitKWorkspace.get(x2d.device, workspace or m * n, tiles, workspace_kind) if tiles else (out, out)
    pdl = pdl_enabled(x2d.device)
    device = x2d.device.index if x2d.device.index is not None else torch.cuda.current_device()
    kernel = kernel_for(pdl, device)
    with torch.cuda.device(device):
        nvrtc.launch(kernel, grid(kernel) if callable(grid) else grid, (threads, 1, 1),
                     [x2d, qweight, scales, zeros, bias if bias is not None else out, out, ws, cnt, m, n, k, *extra,
                      int(bias is not None)], pdl=pdl, shared_bytes=shared_bytes)
    return out


def mma_gemv(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             bias: torch.Tensor | None, cfg: MmaGemvConfig) -> torch.Tensor:
    """x2d [M, K] -> [M, N] in x's dtype, on CUDA; M past cfg.block_m runs as token tiles of block_m rows."""
    m, k = x2d.shape
    n = qweight.shape[1]
    group = k // scales.shape[0]
    if not supports(n, k, group):
        raise ValueError(f"mma-gemv needs N % {BLOCK_N} == 0 and a group of {GROUPS}; got N={n}, group={group}")
    x2d, bias = checked_operands("mma-gemv", x2d, qweight, scales, zeros, bias)
    grid = launch_shape(cfg, m, n, k, group)
    return launch_w4a16(lambda pdl, device: _kernel(x2d.dtype, group, cfg, pdl, device), x2d, qweight, scales, zeros,
                        bias, grid, [cfg.warps * cfg.groups_per_warp], grid[0] * grid[1] if grid[2] > 1 else 0,
                        32 * cfg.warps, shared_bytes=cfg.shared_bytes(group))


def unit_values(qweight: torch.Tensor, dtype: torch.dtype, word: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's decode in PyTorch, built from the same shifts, masks and 1.0 bits: the value each nibble reads as
    and its offset (the value with c = 0), both [K/8, N, 8] in nibble order. Pair decode: 1 + c/16; word decode
    (fp16): 16 + c/64 for nibbles 0, 2, 4, 6, 1 + c/64 for the odd ones."""
    q = qweight.to(torch.int64) & 0xFFFFFFFF
    regs = []  # register I holds nibbles (I, I + 4)
    for i in range(4):
        if word:
            src = q if i < 2 else q >> 8
            regs.append((src & 0x000F000F) | 0x4C004C00 if i % 2 == 0 else (src & 0x00F000F0) | 0x3C003C00)
        else:
            bit, mask, one = (3, 0x00780078, 0x3F803F80) if dtype == torch.bfloat16 else (6, 0x03C003C0, 0x3C003C00)
            shift = bit - 4 * i
            t = ((q << shift) if shift >= 0 else (q >> -shift)) & 0xFFFFFFFF
            regs.append((t & mask) | one)
    halves = [r & 0xFFFF for r in regs] + [r >> 16 for r in regs]  # nibbles 0..3, then 4..7
    bits = torch.stack(halves, dim=-1).to(torch.int16)
    values = bits.view(torch.bfloat16 if dtype == torch.bfloat16 else torch.float16).to(torch.float32)
    offsets = torch.ones(8, dtype=torch.float32, device=qweight.device)
    if word:
        offsets[0::2] = 16.0
    return values, offsets.expand_as(values)


def mma_gemv_reference(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       cfg: MmaGemvConfig = MmaGemvConfig()) -> torch.Tensor:
    """The 8- and 16-row kernel's arithmetic in PyTorch: per group, d = sum x v (v the decoded value), o = sum x
    offset(v) and xs = sum x in fp32, folded as C s (d - o) + z xs (C = 16 pair decode, 64 word decode); the 32-row
    kernel dequantizes to x's dtype instead (within a rounding of this). x2d [M, K] -> [M, N]."""
    m, k = x2d.shape
    n = qweight.shape[1]
    groups = scales.shape[0]
    group = k // groups
    word = word_decode(x2d.dtype, cfg)
    values, offsets = unit_values(qweight, x2d.dtype, word)

    def by_k(t: torch.Tensor) -> torch.Tensor:  # [K/8, N, 8] -> [G, group, N], row 8r + i = nibble i of row r
        return t.permute(0, 2, 1).reshape(groups, group, n)

    x = x2d.to(torch.float32).reshape(m, groups, group)
    d = torch.einsum("mgk,gkn->mgn", x, by_k(values))
    o = torch.einsum("mgk,gkn->mgn", x, by_k(offsets.contiguous()))
    xs = x.sum(dim=-1)[..., None]  # [M, G, 1]
    c = 64.0 if word else 16.0
    y = (c * scales.float() * (d - o) + zeros.float() * xs).sum(dim=1)
    return y.to(x2d.dtype)
