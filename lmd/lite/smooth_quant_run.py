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
SEARCHES = ("auto", "block")  # --smooth-alpha values other than a number
# int8 keeps down_proj in 16 bits by default: its input (silu(gate) · up) is the activation per-token int8 resolves
# worst, +1.0 % of SmolLM2's WikiText-2 ppl by itself (docs/quantization.md); FP8's error is elsewhere.
DEFAULT_IGNORE = {"int8": ("down_proj",), "fp8": ()}


@dataclass(frozen=True)
class SmoothQuantConfig:
    model: str
    work_dir: str
    scheme: str = "int8"
    alpha: float | str = 0.5  # a number, or searched per smoothing group: auto (linear output), block (layer output)
    search_samples: int | None = None  # calibration windows the α search measures errors on (auto 8, block 4)
    ignore: tuple[str, ...] | None = None  # linears kept in 16 bits (--ignore; None: DEFAULT_IGNORE of the scheme)
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
        if isinstance(self.alpha, str) and self.alpha not in SEARCHES or \
                not isinstance(self.alpha, str) and not 0.0 <= self.alpha <= 1.0:
            raise LmdError(f"--smooth-alpha {self.alpha} must be within [0, 1] (SmoothQuant uses 0.5), auto or block")
        if self.search_samples is not None and (not isinstance(self.alpha, str) or self.search_samples < 1):
            raise LmdError(f"--search-samples {self.search_samples}: give at least 1, and only with "
                           "--smooth-alpha auto or block (the search is what reads it)")
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise LmdError(f"--dtype {self.dtype} is unknown; use float16, bfloat16 or float32")
        if self.calib_dir is not None and not self.smoothing:
            raise LmdError("--calib-dir is only read for smoothing; drop it or pass --smooth")

    @property
    def ignored(self) -> tuple[str, ...]:
        return DEFAULT_IGNORE[self.scheme] if self.ignore is None else self.ignore

    @property
    def smoothing(self) -> bool:
        return self.scheme == "int8" if self.smooth is None else self.smooth


@dataclass(frozen=True)
class SmoothQuantResult:
    work_dir: str
    model: str
    scheme: str
    smoothed: bool
    alpha: float | str  # "auto" / "block": searched, see alphas
    smoothed_groups: int
    alphas: list[float]
    ignored: list[str]  # modules kept in 16 bits (besides lm_head)
    calib_dir: str | None
    size_bytes: int
    seconds: float

    def to_json(self) -> dict:
        return asdict(self)


def smooth_quant(cfg: SmoothQuantConfig, on_layer: Callable[[int, int], None] | None = None) -> SmoothQuantResult:
    import torch

    from lmd.arch import get_arch
    from lmd.lite.calibrate import CalibrateConfig, calibrate
    from lmd.lite.llama_view import as_llama, llama_config, needs_llama_view
    from lmd.lite.output_dir import atomic_output_dir, check_output_dir
    from lmd.lite.smooth_quant_export import resolve_ignore, write_checkpoint
    from lmd.model_source import load_causal_lm, load_config, load_tokenizer, resolve_model

    check_output_dir(cfg.work_dir, cfg.force)
    start = time.perf_counter()
    source = resolve_model(cfg.model)
    config = load_config(source)
    view = llama_config(config) if needs_llama_view(config) else config  # Phi-3: the Llama model it is quantized as
    ignore = resolve_ignore(cfg.ignored, get_arch(view), int(config.num_hidden_layers))
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
        model = as_llama(load_causal_lm(source, dtype="float32", device="cpu"))  # Phi-3: its Llama view
        arch = get_arch(model.config)
        alphas = [] if absmax is None else _smooth(cfg, model, arch, source, absmax, ignore)
        provenance = {"model": source.display_name, "scheme": cfg.scheme, "smoothed": absmax is not None,
                      "alpha": cfg.alpha, "alphas": alphas, "ignore": ignore, "calib_dir": calib_dir}
        size = write_checkpoint(tmp, model, load_tokenizer(source), arch, cfg.scheme, getattr(torch, cfg.dtype),
                                provenance, ignore)
    return SmoothQuantResult(str(Path(cfg.work_dir).expanduser().resolve()), source.display_name, cfg.scheme,
                             absmax is not None, cfg.alpha, len(alphas), alphas, ignore, calib_dir, size,
                             round(time.perf_counter() - start, 2))


def _smooth(cfg: SmoothQuantConfig, model, arch, source, absmax: dict, ignore: list[str]) -> list[float]:
    from lmd.lite.smooth_quant import smooth_model
    from lmd.lite.smooth_quant_block import block_search_smooth
    from lmd.lite.smooth_quant_export import QDTYPES

    qdtype = QDTYPES[cfg.scheme]
    if cfg.alpha == "block":
        keep: dict[int, set[str]] = {}
        for module in ignore:
            layer, _, linear = module.removeprefix(f"{arch.layers}.").partition(".")
            keep.setdefault(int(layer), set()).add(linear)
        return block_search_smooth(model, arch, absmax, _calib_ids(cfg, source, 4), qdtype, keep=keep)
    if cfg.alpha == "auto":
        from lmd.lite.smooth_quant_search import SEARCHED_INPUTS, capture_inputs

        inputs = capture_inputs(model, arch, _calib_ids(cfg, source, 8),
                                tuple(getattr(arch, m) for m in SEARCHED_INPUTS))
        return smooth_model(model, arch, absmax, None, inputs, qdtype)
    return smooth_model(model, arch, absmax, float(cfg.alpha))


def _calib_ids(cfg: SmoothQuantConfig, source, default_samples: int):
    """The search's windows [n, seqlen] of the calibration set."""
    from lmd.calib_data import get_calib_samples
    from lmd.model_source import load_tokenizer

    return get_calib_samples(cfg.calib_dataset, load_tokenizer(source), nsamples=cfg.search_samples or default_samples,
                             seqlen=cfg.calib_seqlen, data_dir=cfg.data_dir).input_ids


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
