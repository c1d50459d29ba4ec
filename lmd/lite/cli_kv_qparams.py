"""`lmd kv-qparams WORK_DIR TURBOMIND_DIR`: KV int8 scales/zeros from calibration stats into a workspace."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from lmd.lite.kv_qparams import KVQParamsResult


def kv_qparams_command(
    work_dir: str = typer.Argument(..., help="Calibration work dir holding key_stats.pth and value_stats.pth."),
    turbomind_dir: str = typer.Argument(..., help="workspace/triton_models/weights (or the workspace root)."),
    kv_bits: int = typer.Option(8, "--kv-bits", help="KV cache bits (only 8 is supported)."),
    kv_sym: bool = typer.Option(False, "--kv-sym", help="Symmetric: zero 0, scale absmax/127 (default asymmetric)."),
    granularity: str = typer.Option("head", "--granularity",
                                    help="head: one (scale, zero) per layer and KV head (LMDeploy's); channel: per "
                                         "layer, KV head and head-dim channel (finer, for calibration sequences as "
                                         "long as the contexts served)."),
    num_tp: int = typer.Option(1, "--num-tp", help="Tensor-parallel ranks; must equal config.ini tensor_para_size."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing kv_qparams.rank*.safetensors files."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON instead of a table."),
) -> None:
    """Write kv_qparams.rank{r}.safetensors (per layer and KV head, or per channel) for KV int8 (quant_policy 4)."""
    from lmd.lite.kv_qparams import KVQParamsConfig, export_kv_qparams

    result = export_kv_qparams(KVQParamsConfig(work_dir=work_dir, turbomind_dir=turbomind_dir, kv_bits=kv_bits,
                                               symmetric=kv_sym, num_tp=num_tp,
                                               granularity=granularity, force=force))
    if json_out:
        typer.echo(json.dumps(result.to_json()))
    else:
        _print_table(result)


def _print_table(result: KVQParamsResult) -> None:
    from rich.console import Console
    from rich.table import Table

    kind = ("symmetric" if result.symmetric else "asymmetric") + (", per channel" if result.per_channel else ", per head")
    table = Table(title=f"KV int8 qparams ({kind})",
                  caption=f"{result.num_layers} layers × {result.kv_heads} kv heads, tp {result.num_tp}; "
                          "set quant_policy = 4 in config.ini to use them")
    for column in ("", "scale min", "scale max", "zero min", "zero max"):
        table.add_column(column, justify="left" if not column else "right")
    for name, scale, zero in (("keys", result.k_scale_range, result.k_zero_range),
                              ("values", result.v_scale_range, result.v_zero_range)):
        table.add_row(name, *(f"{x:.4g}" for x in (*scale, *zero)))
    console = Console()
    console.print(table)
    for path in result.files:
        console.print(f"wrote {path}")

