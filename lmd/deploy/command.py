"""The `lmd deploy` command: flags map one-to-one onto `lmd.deploy.converter.run_deploy`."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from lmd.errors import LmdError


def deploy_command(
    model_name: Annotated[str, typer.Argument(help="Chat template name: llama2, llama3, vicuna, internlm, qwen, "
                                                   "mistral, base (no template) or hf (the tokenizer's own).")],
    model_path: Annotated[str, typer.Argument(help="HF model directory, AWQ / GPTQ / compressed-tensors "
                                                   "checkpoint directory or .gguf file.")],
    model_format: Annotated[str | None, typer.Option(help="hf, awq, gptq (also takes compressed-tensors "
                                                           "pack-quantized), compressed-tensors or gguf; detected from "
                                                           "quantization_config when left out.")] = None,
    group_size: Annotated[int | None, typer.Option(help="int4 group size; must match the checkpoint's (default: "
                                                        "the checkpoint's; per-channel checkpoints: the widest of "
                                                        "128/64/32 dividing every K).")] = None,
    tp: Annotated[int, typer.Option(help="Tensor-parallel ranks to write rank files for: any TP dividing the query "
                                    "heads, KV heads and MLP width (the engine's fast path at that TP; it can still "
                                    "run another one).")] = 1,
    dst_path: Annotated[str, typer.Option(help="Workspace directory to create.")] = "./workspace",
    tokenizer_path: Annotated[str | None, typer.Option(help="Tokenizer dir or .gguf (default: the model's).")] = None,
    dtype: Annotated[str | None, typer.Option(help="float16, bfloat16 or float32 weights (int4: compute dtype); "
                                                   "default: bfloat16 for bf16 HF models, else float16.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing non-empty --dst-path.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a table.")] = False,
) -> None:
    """Convert a model into a TurboMind-style workspace (config.ini + per-rank safetensors + tokenizer)."""
    from lmd.chat_templates import get_chat_template

    get_chat_template(model_name)  # a typo in MODEL_NAME fails before torch is imported
    if dtype is not None and dtype not in ("float16", "bfloat16", "float32"):
        raise LmdError(f"--dtype {dtype} is unknown; use float16, bfloat16 or float32")
    from lmd.deploy.converter import run_deploy

    result = run_deploy(model_name, model_path, dst_path, model_format, group_size, tp, tokenizer_path, dtype, force,
                        progress=not as_json)
    summary = {"dst_path": str(result.path), "model_name": result.model_name, "model_format": result.model_format,
               "weight_type": result.weight_type, "group_size": result.group_size, "tp": result.tp,
               "tensors": result.num_tensors, "size_bytes": result.size_bytes, "seconds": round(result.seconds, 2)}
    if as_json:
        print(json.dumps(summary))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lmd deploy", show_header=False)
    for key, value in summary.items():
        table.add_row(key, _human(value) if key == "size_bytes" else str(value))
    Console().print(table)


def _human(size: object) -> str:
    value = float(size)  # type: ignore[arg-type]
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
