"""`lmd smooth-quant MODEL --work-dir W`: W8A8 (int8 SmoothQuant, or --fp8) compressed-tensors HF directory."""

from __future__ import annotations

import json

import typer

from lmd.errors import LmdError
from lmd.lite.smooth_quant_run import SEARCHES


def smooth_quant_command(
    model: str = typer.Argument(..., help="HF model directory, .gguf file or hub id."),
    work_dir: str = typer.Option("./work_dir", "--work-dir", help="Output HF directory (W8A8 compressed-tensors)."),
    fp8: bool = typer.Option(False, "--fp8", help="FP8 e4m3 weights and activations instead of int8."),
    smooth_alpha: str = typer.Option("0.5", "--smooth-alpha",
                                     help="SmoothQuant migration strength α in [0, 1]: s = max|x|^α / max|W|^(1-α); "
                                          "auto: per smoothing group, the α of 0.2..0.8 with the least W8A8 error "
                                          "of that group's linear outputs; block: per smoothing group, the α of "
                                          "0.3..0.9 with the least W8A8 error of the whole decoder layer's output, "
                                          "layer by layer (both on --search-samples calibration windows)."),
    search_samples: int | None = typer.Option(None, "--search-samples",
                                              help="Calibration windows (of --calib-dataset, --calib-seqlen) the "
                                                   "α search measures on (default 8 for auto, 4 for block)."),
    ignore: list[str] | None = typer.Option(None, "--ignore",
                                            help="Keep this linear in 16 bits (weights and activations; "
                                                 "compressed-tensors `ignore`), repeatable: a linear name such as "
                                                 "down_proj (every layer) or one module such as "
                                                 "model.layers.3.mlp.down_proj. q/k/v and gate/up go together. "
                                                 "Default: down_proj for int8 (its input is int8's worst "
                                                 "activation), nothing for --fp8; `--ignore none` quantizes every "
                                                 "decoder linear."),
    smooth: bool | None = typer.Option(None, "--smooth/--no-smooth",
                                       help="Migrate activation outliers into the weights (default: on for int8, "
                                            "off for --fp8)."),
    calib_dir: str | None = typer.Option(None, "--calib-dir",
                                         help="An `lmd calibrate` work dir to take inputs_stats.pth from (default: "
                                              "calibrate now, into WORK_DIR/calibration)."),
    calib_dataset: str = typer.Option("c4", "--calib-dataset", help="Calibration set when calibrating now."),
    calib_samples: int = typer.Option(128, "--calib-samples", help="Calibration windows when calibrating now."),
    calib_seqlen: int = typer.Option(2048, "--calib-seqlen", help="Tokens per calibration window."),
    data_dir: str | None = typer.Option(None, "--data-dir",
                                        help="Local data mirror laid out like ../shared/data (default $LMD_DATA_DIR)."),
    device: str = typer.Option("cpu", "--device", help="Calibration device (cpu or cuda)."),
    dtype: str = typer.Option("float16", "--dtype",
                              help="dtype of the tensors left in float (embeddings, norms): float16, bfloat16, "
                                   "float32."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty existing --work-dir."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON instead of a table."),
) -> None:
    """Quantize a model to W8A8: per-channel 8-bit weights, per-token dynamic 8-bit activations (deploy with
    `lmd deploy`: weight_type int8 or fp8)."""
    from lmd.lite.cli_calibrate import _layer_progress
    from lmd.lite.smooth_quant_run import SmoothQuantConfig, smooth_quant

    cfg = SmoothQuantConfig(model=model, work_dir=work_dir, scheme="fp8" if fp8 else "int8", alpha=_alpha(smooth_alpha),
                            search_samples=search_samples, ignore=_ignore(ignore),
                            smooth=smooth, calib_dir=calib_dir, calib_dataset=calib_dataset,
                            calib_samples=calib_samples, calib_seqlen=calib_seqlen, data_dir=data_dir, device=device,
                            dtype=dtype, force=force)
    with _layer_progress(enabled=not json_out) as on_layer:
        result = smooth_quant(cfg, on_layer)
    if json_out:
        typer.echo(json.dumps(result.to_json()))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lmd smooth-quant", show_header=False)
    for key, value in result.to_json().items():
        table.add_row(key, str(value))
    Console().print(table)


def _alpha(text: str) -> float | str:
    if text in SEARCHES:
        return text
    try:
        return float(text)
    except ValueError:
        raise LmdError(f"--smooth-alpha {text} is not a number; give one in [0, 1], auto or block") from None


def _ignore(names: list[str] | None) -> tuple[str, ...] | None:
    if not names:
        return None
    if "none" in names and len(names) > 1:
        raise LmdError(f"--ignore none quantizes every linear; drop it or the other --ignore names ({names})")
    return () if names == ["none"] else tuple(names)
