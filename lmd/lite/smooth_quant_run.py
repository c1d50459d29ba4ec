"""`lmd smooth-quant`: load the float model, smooth it with the calibration statistics (int8; optional for FP8),
quantize every decoder linear to W8A8 and write the compressed-tensors HF directory atomically.

Statistics come from `--calib-dir` (an `lmd calibrate` work dir) or, without it, from a calibration run of this
command, kept in `<work-dir>/calibration/` so the output says what it was smoothed with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from lmd.errors import LmdError

SCHEMES = ("int8", "fp8")


@dataclass(frozen=True)
class SmoothQuantConfig:
    model: str
    work_dir: str
    scheme: str = "int8"
    alpha: float = 0.5
    smooth: bool | None = None  # None: on for int8, off for fp8
    calib_dir: str | None = None
    calib_dataset: str = "c4"
    calib_samples: int = 128
    calib_seqlen: int = 2048
    data_dir: str | None = None
    device: str = "cpu"
    dtype: str = "float16"
    force: bool = False

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise LmdError(f"scheme {self.scheme!r} is unknown; use int8 or fp8 (--fp8)")
        if not 0.0 <= self.alpha <= 1.0:
            raise LmdError(f"--smooth-alpha {self.alpha} must be within [0, 1] (SmoothQuant uses 0.5)")
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise LmdError(f"--dtype {self.dtype} is unknown; use float16, bfloat16 or float32")
        if self.calib_dir is not None and not self.smoothing:
            raise LmdError("--calib-dir is only read for smoothing; drop it or pass --smooth")

    @property
    def smoothing(self) -> bool:
        return self.scheme == "int8" if self.smooth is None else self.smooth


@dataclass(frozen=True)
class SmoothQuantResult:
    work_dir: str
    model: str
    scheme: str
    smoothed: bool
    alpha: float
    smoothed_groups: int
    calib_dir: str | None
    size_bytes: int
    seconds: float

    def to_json(self) -> dict:
        return asdict(self)


def smooth_quant(cfg: SmoothQuantConfig, on_layer: Callable[[int, int], None] | None = None) -> SmoothQuantResult:
    import torch

    from lmd.arch import get_arch
    from lmd.lite.calibrate import CalibrateConfig, calibrate
    from lmd.lite.output_dir import atomic_output_dir, check_output_dir
    from lmd.lite.smooth_quant import smooth_model
    from lmd.lite.smooth_quant_export import write_checkpoint
    from lmd.model_source import load_causal_lm, load_tokenizer, resolve_model

    check_output_dir(cfg.work_dir, cfg.force)
    start = time.perf_counter()
    source = resolve_model(cfg.model)
    absmax = _load_input_absmax(Path(cfg.calib_dir)) if cfg.calib_dir and cfg.smoothing else None
    with atomic_output_dir(cfg.work_dir, cfg.force) as tmp:
        calib_dir = cfg.calib_dir
        if cfg.smoothing and absmax is None:
            calib_dir = str(tmp / "calibration")
            calibrate(CalibrateConfig(model=cfg.model, work_dir=calib_dir, calib_dataset=cfg.calib_dataset,
                                      calib_samples=cfg.calib_samples, calib_seqlen=cfg.calib_seqlen,
                                      data_dir=cfg.data_dir, device=cfg.device), on_layer)
            absmax = _load_input_absmax(Path(calib_dir))
            calib_dir = str(Path(cfg.work_dir).expanduser().resolve() / "calibration")
        model = load_causal_lm(source, dtype="float32", device="cpu")
        arch = get_arch(model.config)
        groups = smooth_model(model, arch, absmax, cfg.alpha) if absmax is not None else 0
        provenance = {"model": source.display_name, "scheme": cfg.scheme, "smoothed": absmax is not None,
                      "alpha": cfg.alpha, "calib_dir": calib_dir}
        size = write_checkpoint(tmp, model, load_tokenizer(source), arch, cfg.scheme, getattr(torch, cfg.dtype),
                                provenance)
    return SmoothQuantResult(str(Path(cfg.work_dir).expanduser().resolve()), source.display_name, cfg.scheme,
                             absmax is not None, cfg.alpha, groups, calib_dir, size,
                             round(time.perf_counter() - start, 2))


def _load_input_absmax(calib_dir: Path) -> dict:
    import torch

    path = calib_dir.expanduser() / "inputs_stats.pth"
    if not path.is_file():
        raise LmdError(f"{path} is missing; run `lmd calibrate MODEL --work-dir {calib_dir}` first")
    try:
        stats = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file for the user
        raise LmdError(f"{path} is not a readable stats file ({type(exc).__name__}); re-run `lmd calibrate`") from None
    if not isinstance(stats, dict) or "absmax" not in stats:
        raise LmdError(f"{path} lacks the absmax stats; re-run `lmd calibrate`")
    return stats["absmax"]
