"""`lmd eval ppl MODEL`: perplexity of an HF directory or a GGUF file on wikitext2/ptb/c4/pileval/pydoc or a path."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from lmd.errors import LmdError

if TYPE_CHECKING:
    import torch

    from lmd.eval.ppl import PplResult

ENGINE_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # --dtype -> the engine's dtype names


@dataclass(frozen=True)
class ScoringModel:
    """What perplexity needs from MODEL: a display name, its tokenizer, and a window scorer."""

    name: str
    tokenizer: Any
    score_window: Callable[[torch.Tensor], float]
    max_positions: int | None = None


def load_scoring_model(model: str, device: str = "cpu", dtype: str = "float32", seqlen: int = 2048) -> ScoringModel:
    """Build the scorer for MODEL (an HF model directory, a .gguf file, or a workspace scored through the engine)."""
    from lmd.turbomind.workspace import is_workspace

    if is_workspace(model):
        return _workspace_scoring_model(model, device, dtype, seqlen)
    from lmd.eval.ppl import hf_window_scorer

    name, config, tokenizer, lm = load_hf_model(model, device, dtype)
    return ScoringModel(name, tokenizer, hf_window_scorer(lm, device), getattr(config, "max_position_embeddings", None))


def load_hf_model(model: str, device: str, dtype: str) -> tuple[str, Any, Any, Any]:
    """(display name, config, tokenizer, model) of an HF directory, a .gguf file or a hub id."""
    from lmd.model_source import load_causal_lm, load_config, load_tokenizer, resolve_model

    source = resolve_model(model)
    config = load_config(source)  # an unreadable config fails here, before the slow weight load
    tokenizer = load_tokenizer(source)
    return source.display_name, config, tokenizer, load_causal_lm(source, dtype=dtype, device=device)


def _workspace_scoring_model(workspace: str, device: str, dtype: str, seqlen: int) -> ScoringModel:
    """Windows run through the engine's model in prefill chunks over its paged KV cache (config.ini's quant_policy,
    weight type and block size apply); --dtype picks the compute dtype."""
    from lmd.turbomind.window_scorer import engine_window_scorer, scoring_engine

    engine = scoring_engine(workspace, seqlen, device=device, dtype=ENGINE_DTYPES[dtype])
    return ScoringModel(f"{workspace} (engine)", engine.tokenizer, engine_window_scorer(engine),
                        engine.workspace.model.max_position_embeddings)


def check_model_flags(model: str, device: str, dtype: str) -> None:
    """What every `lmd eval` command checks before reading data or weights."""
    from lmd.model_source import DTYPES, check_device

    if dtype not in DTYPES:
        raise LmdError(f"--dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if not Path(model).expanduser().exists():
        raise LmdError(f"model path {model} does not exist; give an HF model directory, a .gguf file or a workspace")
    check_device(device)


def ppl_command(
    model: str = typer.Argument(..., help="HF model directory, .gguf file, or an lmd workspace (run by the engine)."),
    dataset: str = typer.Option("wikitext2", "--dataset",
                                help="wikitext2, ptb, c4, pileval, pydoc, or a path (.txt/.raw/.jsonl/.json/.parquet "
                                     "or a directory of them)."),
    split: str = typer.Option("test", "--split", help="train, validation or test (c4 evaluates validation)."),
    seqlen: int = typer.Option(2048, "--seqlen", help="Tokens per non-overlapping window."),
    max_windows: int | None = typer.Option(None, "--max-windows", help="Score only the first N windows."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, float16 or bfloat16."),
    data_dir: str | None = typer.Option(None, "--data-dir",
                                        help="Local data mirror laid out like ../shared/data (default $LMD_DATA_DIR)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON instead of a table."),
) -> None:
    """Perplexity by the llm-awq/GPTQ protocol: non-overlapping windows, mean NLL over all predicted tokens."""
    from lmd.calib_data import load_eval_text
    from lmd.calib_data.sources import say
    from lmd.calib_data.tokenization import encode
    from lmd.eval.ppl import perplexity

    if seqlen < 2:
        raise LmdError(f"--seqlen must be at least 2 (got {seqlen})")
    if max_windows is not None and max_windows < 1:
        raise LmdError(f"--max-windows must be at least 1 (got {max_windows})")
    check_model_flags(model, device, dtype)
    text = load_eval_text(dataset, split, data_dir)
    scorer = load_scoring_model(model, device, dtype, seqlen)
    if scorer.max_positions is not None and seqlen > scorer.max_positions:
        say(f"--seqlen {seqlen} exceeds the model's max_position_embeddings {scorer.max_positions}")
    caps = [n for n in (max_windows, text.max_windows) if n is not None]
    ids = encode(scorer.tokenizer, text.text)
    result = perplexity(scorer.score_window, ids, seqlen=seqlen, max_windows=min(caps) if caps else None,
                        progress=not json_out, dataset=text.dataset, split=text.split)
    if json_out:
        typer.echo(json.dumps({"model": scorer.name, **asdict(result), "source": text.source,
                               "device": device, "dtype": dtype}))
    else:
        _print_table(scorer.name, result, text.source)


def _print_table(model: str, result: PplResult, source: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="perplexity", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    rows = (("model", model), ("dataset", result.dataset), ("split", result.split), ("data", source),
            ("seqlen", str(result.seqlen)), ("ppl", f"{result.ppl:.4f}"), ("tokens", str(result.tokens)),
            ("windows", str(result.windows)), ("seconds", f"{result.seconds:.1f}"))
    for field, value in rows:
        table.add_row(field, value)
    Console().print(table)
