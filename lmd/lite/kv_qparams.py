"""`lmd kv-qparams`: static KV-cache int8 parameters from calibration stats, written into a workspace.

Format (docs/workspace.md, `kv_qparams.rank{r}.safetensors`): fp32 `layers.{i}.{k,v}_{scale,zero}` of shape
[Hkv / R] (`--granularity head`, the default) or [Hkv / R, D] (`channel`), this rank's KV heads in head order; metadata
`kv_bits`, `symmetric`, `num_tp`, `granularity`. Per layer and KV head (and channel), from the calibration stats
(reduced over the head dim for `head`):

    asymmetric: zero = (min + max) / 2, scale = (max - min) / 255     q = clamp(round((x - zero) / scale), -128, 127)
    symmetric:  zero = 0,               scale = absmax / 127           x = q * scale + zero
"""

from __future__ import annotations

import configparser
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lmd.errors import LmdError

if TYPE_CHECKING:
    import torch

SUPPORTED_BITS = (8,)
# head: one (scale, zero) per layer and KV head (LMDeploy's granularity, the default); channel: per layer, KV head and
# head-dim channel. Keys after RoPE have a few channels far wider than the rest, so channel is finer (SmolLM2, c4
# 128 x 2048 calibration: +0.05 % ppl vs +0.38 %, docs/engine.md) -- but a low-frequency RoPE channel only shows the
# range of the positions the calibration covered: with 512-token samples evaluated at 1024 tokens, channel cost +1.7 %
# where head cost -0.05 %. Use channel when the calibration sequences are as long as the contexts served.
GRANULARITIES = ("head", "channel")
# A channel that never varied would get scale 0 and divide by zero in the engine; its values quantize to `zero`.
MIN_SCALE = 1e-8


@dataclass(frozen=True)
class KVQParamsConfig:
    work_dir: str
    turbomind_dir: str
    kv_bits: int = 8
    symmetric: bool = False
    num_tp: int = 1
    granularity: str = "head"
    force: bool = False

    def __post_init__(self) -> None:
        if self.kv_bits not in SUPPORTED_BITS:
            raise LmdError(f"--kv-bits {self.kv_bits} is not supported; the engine's KV cache quantization is int8, "
                           "use --kv-bits 8")
        if self.num_tp < 1:
            raise LmdError(f"--num-tp must be at least 1 (got {self.num_tp})")
        if self.granularity not in GRANULARITIES:
            raise LmdError(f"--granularity {self.granularity!r} is not valid; use channel or head")

    @property
    def per_channel(self) -> bool:
        return self.granularity == "channel"


@dataclass(frozen=True)
class KVQParamsResult:
    weights_dir: str
    files: tuple[str, ...]
    num_layers: int
    kv_heads: int
    num_tp: int
    symmetric: bool
    per_channel: bool
    k_scale_range: tuple[float, float]
    v_scale_range: tuple[float, float]
    k_zero_range: tuple[float, float]
    v_zero_range: tuple[float, float]

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class WorkspaceShape:
    """The config.ini keys kv-qparams checks the stats against."""

    path: Path
    tensor_para_size: int
    head_num: int
    kv_head_num: int
    size_per_head: int
    num_layer: int


def find_weights_dir(turbomind_dir: str | Path) -> Path:
    """Accept `workspace/triton_models/weights` or the workspace root."""
    path = Path(turbomind_dir).expanduser()
    for candidate in (path, path / "triton_models" / "weights"):
        if (candidate / "config.ini").is_file():
            return candidate
    raise LmdError(f"{path} holds no config.ini (nor triton_models/weights/config.ini); give a workspace written by "
                   "`lmd deploy` or its triton_models/weights directory")


def read_workspace_shape(weights_dir: Path) -> WorkspaceShape:
    path = weights_dir / "config.ini"
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
        section = parser["llama"]
        values = {key: int(section[key]) for key in
                  ("tensor_para_size", "head_num", "kv_head_num", "size_per_head", "num_layer")}
    except KeyError as exc:
        raise LmdError(f"{path}: missing [llama] key {exc}; redeploy the workspace with `lmd deploy`") from exc
    except (ValueError, configparser.Error) as exc:
        raise LmdError(f"{path}: unreadable ({exc}); redeploy the workspace with `lmd deploy`") from exc
    return WorkspaceShape(path=path, **values)


def layer_order(stats: dict[str, torch.Tensor], path: str) -> list[str]:
    """Decoder layer names sorted by their trailing index; they must be 0..n-1."""
    indexed = []
    for name in stats:
        match = re.search(r"(\d+)$", name)
        if match is None:
            raise LmdError(f"{path}: entry {name!r} is not a decoder layer name; re-run `lmd calibrate`")
        indexed.append((int(match.group(1)), name))
    indexed.sort()
    if [i for i, _ in indexed] != list(range(len(indexed))):
        raise LmdError(f"{path}: layer indices {[i for i, _ in indexed]} are not 0..{len(indexed) - 1}; "
                       "re-run `lmd calibrate`")
    return [name for _, name in indexed]


def compute_qparams(stats: dict[str, dict[str, torch.Tensor]], symmetric: bool, kv_bits: int = 8,
                    per_channel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero), each fp32 [num_layers, kv_heads] (or [num_layers, kv_heads, head_dim] per channel), from one
    key_stats/value_stats dict of [kv_heads, head_dim] tensors per layer."""
    import torch

    names = layer_order(stats["max"], "stats")

    def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        return t.float() if per_channel else getattr(t.float(), op)(-1)

    if symmetric:
        absmax = torch.stack([reduce(stats["absmax"][n], "amax") for n in names])
        scale = absmax / (2 ** (kv_bits - 1) - 1)
        zero = torch.zeros_like(scale)
    else:
        hi = torch.stack([reduce(stats["max"][n], "amax") for n in names])
        lo = torch.stack([reduce(stats["min"][n], "amin") for n in names])
        scale = (hi - lo) / (2 ** kv_bits - 1)
        zero = (hi + lo) / 2
    return scale.clamp(min=MIN_SCALE), zero


def rank_tensors(k: tuple[torch.Tensor, torch.Tensor], v: tuple[torch.Tensor, torch.Tensor], num_tp: int,
                 rank: int) -> dict[str, torch.Tensor]:
    """The tensors of one rank's file: its contiguous slice of KV heads per layer."""
    heads = k[0].shape[1] // num_tp
    cols = slice(rank * heads, (rank + 1) * heads)
    out: dict[str, torch.Tensor] = {}
    for layer in range(k[0].shape[0]):
        out[f"layers.{layer}.k_scale"] = k[0][layer, cols].contiguous()
        out[f"layers.{layer}.k_zero"] = k[1][layer, cols].contiguous()
        out[f"layers.{layer}.v_scale"] = v[0][layer, cols].contiguous()
        out[f"layers.{layer}.v_zero"] = v[1][layer, cols].contiguous()
    return out


def export_kv_qparams(cfg: KVQParamsConfig) -> KVQParamsResult:
    from safetensors.torch import save_file

    from lmd.lite.calibrate import CALIB_JSON, load_kv_stats
    from lmd.lite.output_dir import atomic_output_file

    weights_dir = find_weights_dir(cfg.turbomind_dir)
    shape = read_workspace_shape(weights_dir)
    key_stats, value_stats = load_kv_stats(cfg.work_dir)
    _check_shapes(shape, key_stats, cfg, Path(cfg.work_dir).expanduser())
    targets = [weights_dir / f"kv_qparams.rank{r}.safetensors" for r in range(cfg.num_tp)]
    existing = [t.name for t in sorted(weights_dir.glob("kv_qparams.rank*.safetensors"))]
    if existing and not cfg.force:
        raise LmdError(f"{weights_dir} already holds {', '.join(existing)}; pass --force to overwrite them")
    k = compute_qparams(key_stats, cfg.symmetric, cfg.kv_bits, cfg.per_channel)
    v = compute_qparams(value_stats, cfg.symmetric, cfg.kv_bits, cfg.per_channel)
    metadata = {"kv_bits": str(cfg.kv_bits), "symmetric": "1" if cfg.symmetric else "0", "num_tp": str(cfg.num_tp),
                "granularity": "channel" if cfg.per_channel else "head"}
    calib_json = Path(cfg.work_dir).expanduser() / CALIB_JSON
    if calib_json.is_file():
        metadata["calibration"] = calib_json.read_text()
    for rank, target in enumerate(targets):
        with atomic_output_file(target) as tmp:
            save_file(rank_tensors(k, v, cfg.num_tp, rank), str(tmp), metadata={**metadata, "rank": str(rank)})
    return KVQParamsResult(
        weights_dir=str(weights_dir.resolve()), files=tuple(str(t.resolve()) for t in targets),
        num_layers=int(k[0].shape[0]), kv_heads=int(k[0].shape[1]), num_tp=cfg.num_tp, symmetric=cfg.symmetric,
        per_channel=cfg.per_channel,
        k_scale_range=_range(k[0]), v_scale_range=_range(v[0]), k_zero_range=_range(k[1]), v_zero_range=_range(v[1]))


def _check_shapes(shape: WorkspaceShape, key_stats: dict, cfg: KVQParamsConfig, work_dir: Path) -> None:
    ini = shape.path
    if cfg.num_tp != shape.tensor_para_size:
        raise LmdError(f"--num-tp {cfg.num_tp} does not match {ini} tensor_para_size={shape.tensor_para_size}; "
                       f"use --num-tp {shape.tensor_para_size} (or redeploy with --tp {cfg.num_tp})")
    names = layer_order(key_stats["max"], str(work_dir / "key_stats.pth"))
    heads, head_dim = key_stats["max"][names[0]].shape
    found = {"num_layer": len(names), "kv_head_num": int(heads), "size_per_head": int(head_dim)}
    calib_json = work_dir / "calib.json"
    if calib_json.is_file():
        num_heads = json.loads(calib_json.read_text()).get("num_heads")
        if num_heads is not None:
            found["head_num"] = int(num_heads)
    for key, value in found.items():
        if value != getattr(shape, key):
            raise LmdError(f"calibration stats in {work_dir} have {key}={value} but {ini} has {key}="
                           f"{getattr(shape, key)}; calibrate the same model the workspace was deployed from")
    if heads % cfg.num_tp:
        raise LmdError(f"kv_head_num={heads} is not divisible by --num-tp {cfg.num_tp}")


def _range(t: torch.Tensor) -> tuple[float, float]:
    return float(t.min()), float(t.max())
