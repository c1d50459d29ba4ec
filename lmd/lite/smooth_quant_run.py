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
    alpha: float | None = 0.5  # None: searched per smoothing group (--smooth-alpha auto)
    search_samples: int | None = None  # calibration windows the α search measures errors on (auto only; 8)
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
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise LmdError(f"--smooth-alpha {self.alpha} must be within [0, 1] (SmoothQuant uses 0.5) or auto")
        if self.search_samples is not None and (self.alpha is not None or self.search_samples < 1):
            raise LmdError(f"--search-samples {self.search_samples}: give at least 1, and only with "
                           "--smooth-alpha auto (the search is what reads it)")
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
    alpha: float | str  # "auto": searched, see alphas
    smoothed_groups: int
    alphas: list[float]
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
    from lmd.lite.smooth_quant_export import QDTYPES, write_checkpoint
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
        inputs = _search_inputs(cfg, model, arch, source) if absmax is not None and cfg.alpha is None else None
        alphas = [] if absmax is None else smooth_model(model, arch, absmax, cfg.alpha, inputs,
                                                        QDTYPES[cfg.scheme])
        alpha = "auto" if cfg.alpha is None else cfg.alpha
        provenance = {"model": source.display_name, "scheme": cfg.scheme, "smoothed": absmax is not None,
                      "alpha": alpha, "alphas": alphas, "calib_dir": calib_dir}
        size = write_checkpoint(tmp, model, load_tokenizer(source), arch, cfg.scheme, getattr(torch, cfg.dtype),
                                provenance)
    return SmoothQuantResult(str(Path(cfg.work_dir).expanduser().resolve()), source.display_name, cfg.scheme,
                             absmax is not None, alpha, len(alphas), alphas, calib_dir, size,
                             round(time.perf_counter() - start, 2))


def _search_inputs(cfg: SmoothQuantConfig, model, arch, source) -> dict:
    from lmd.calib_data import get_calib_samples
    from lmd.lite.smooth_quant_search import SEARCHED_INPUTS, capture_inputs
    from lmd.model_source import load_tokenizer

    calib = get_calib_samples(cfg.calib_dataset, load_tokenizer(source), nsamples=cfg.search_samples or 8,
                              seqlen=cfg.calib_seqlen, data_dir=cfg.data_dir)
    return capture_inputs(model, arch, calib.input_ids, tuple(getattr(arch, m) for m in SEARCHED_INPUTS))


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
