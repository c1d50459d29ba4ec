"""`lmd calibrate`: activation and KV statistics of a model on a calibration set, in LMDeploy's file layout.

Work dir contents (all `torch.save`d dicts of float32 CPU tensors; see `calib_stats` for what each stat means):

    inputs_stats.pth    {stat: {linear full name: [in_features]}}            stat in max, min, mean, absmax, absmean
    outputs_stats.pth   {stat: {linear or norm full name: [out_features]}}   same stats; norms incl. the final norm
    key_stats.pth       {stat: {decoder layer full name: [kv_heads, head_dim]}}   stat in max, min, absmax
    value_stats.pth     same as key_stats for the values
    calib.json          what produced them (model, dataset, split, samples, seqlen, seed, lmd version, device, seconds)

Samples run one decoder layer at a time (`layerwise`): only that layer's weights visit the compute device.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lmd.errors import LmdError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from lmd.lite.calib_stats import CalibStats

STATS_FILES = ("inputs_stats.pth", "outputs_stats.pth", "key_stats.pth", "value_stats.pth")
CALIB_JSON = "calib.json"


@dataclass(frozen=True)
class CalibrateConfig:
    model: str
    work_dir: str
    calib_dataset: str = "c4"
    calib_samples: int = 128
    calib_seqlen: int = 2048
    calib_split: str | None = None
    seed: int = 0
    device: str = "cpu"
    dtype: str = "auto"
    batch_size: int = 1
    data_dir: str | None = None
    force: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise LmdError(f"--batch-size must be at least 1 (got {self.batch_size})")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise LmdError(f"--dtype {self.dtype!r} is not supported; use auto, float32, float16 or bfloat16")

    @property
    def model_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "float16"


@dataclass(frozen=True)
class CalibrateResult:
    work_dir: str
    model: str
    dataset: str
    split: str
    source: str
    samples: int
    seqlen: int
    seed: int
    device: str
    dtype: str
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    seconds: float
    lmd_version: str

    def to_json(self) -> dict:
        return asdict(self)


# on_layer(done, total) is called after each decoder layer (and once with done=0 before the first).
LayerCallback = Callable[[int, int], None]


def calibrate(cfg: CalibrateConfig, on_layer: LayerCallback | None = None) -> CalibrateResult:
    import torch

    import lmd
    from lmd.calib_data import get_calib_samples
    from lmd.lite.llama_view import as_llama
    from lmd.lite.output_dir import atomic_output_dir, check_output_dir
    from lmd.model_source import check_device, load_causal_lm, load_tokenizer, resolve_model

    check_output_dir(cfg.work_dir, cfg.force)
    device = check_device(cfg.device)
    start = time.perf_counter()
    source = resolve_model(cfg.model)
    tokenizer = load_tokenizer(source)
    calib = get_calib_samples(cfg.calib_dataset, tokenizer, nsamples=cfg.calib_samples, seqlen=cfg.calib_seqlen,
                              seed=cfg.seed, split=cfg.calib_split, data_dir=cfg.data_dir)
    model = as_llama(load_causal_lm(source, dtype=cfg.model_dtype, device="cpu"))  # Phi-3: its Llama view
    stats = collect_stats(model, calib.input_ids, device, cfg.batch_size, on_layer)
    exported = stats.export()
    kv_heads, head_dim = next(iter(exported["key_stats"]["max"].values())).shape
    result = CalibrateResult(
        work_dir=str(Path(cfg.work_dir).expanduser().resolve()), model=source.display_name, dataset=calib.dataset,
        split=calib.split, source=calib.source, samples=calib.nsamples, seqlen=calib.seqlen, seed=calib.seed,
        device=device, dtype=cfg.model_dtype, num_layers=len(exported["key_stats"]["max"]),
        num_heads=int(model.config.num_attention_heads), kv_heads=int(kv_heads),
        head_dim=int(head_dim), seconds=round(time.perf_counter() - start, 2), lmd_version=lmd.__version__)
    with atomic_output_dir(cfg.work_dir, cfg.force) as tmp:
        for stem, payload in exported.items():
            torch.save(payload, tmp / f"{stem}.pth")
        (tmp / CALIB_JSON).write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return result


def collect_stats(model: PreTrainedModel, input_ids, device: str, batch_size: int,
                  on_layer: LayerCallback | None = None) -> CalibStats:
    """Run `input_ids` [n, L] through `model` layer by layer with observers attached; the model stays where it is."""
    from lmd.arch import decoder_layers, get_arch, get_module
    from lmd.lite.calib_stats import CalibStats, LayerHooks, observe_final_norm
    from lmd.lite.layerwise import capture_layer0_inputs, layer_on, run_layer

    config = model.config
    arch = get_arch(config)
    layers = decoder_layers(model, config)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    stats = CalibStats()
    if on_layer:
        on_layer(0, len(layers))
    inputs = capture_layer0_inputs(model, input_ids, device, batch_size)
    for index, layer in enumerate(layers):
        name = f"{arch.layers}.{index}"
        with layer_on(layer, device), LayerHooks(stats, layer, name, arch, num_kv_heads, head_dim):
            inputs = run_layer(layer, inputs, device)
        if on_layer:
            on_layer(index + 1, len(layers))
    norm = get_module(model, arch.final_norm)
    with layer_on(norm, device):
        observe_final_norm(stats, norm, arch.final_norm, inputs.hidden, device)
    return stats


def load_kv_stats(work_dir: str | Path) -> tuple[dict, dict]:
    """key_stats and value_stats of a calibration work dir, with one-line errors for missing or foreign files."""
    import torch

    work = Path(work_dir).expanduser()
    if not work.is_dir():
        raise LmdError(f"work dir {work} does not exist; run `lmd calibrate MODEL --work-dir {work}` first")
    loaded = []
    for name in ("key_stats.pth", "value_stats.pth"):
        path = work / name
        if not path.is_file():
            raise LmdError(f"{path} is missing; run `lmd calibrate MODEL --work-dir {work}` first")
        try:
            stats = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file for the user
            raise LmdError(f"{path} is not a readable stats file ({type(exc).__name__}); re-run `lmd calibrate`") from exc
        if not isinstance(stats, dict) or not all(k in stats for k in ("max", "min", "absmax")):
            raise LmdError(f"{path} lacks the max/min/absmax stats; re-run `lmd calibrate`")
        loaded.append(stats)
    return loaded[0], loaded[1]
