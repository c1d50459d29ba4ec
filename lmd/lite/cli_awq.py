"""`lmd awq MODEL --work-dir W`: AWQ int4 weight quantization into an AutoAWQ "gemm" HF directory, with a ppl report."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import typer

from lmd.errors import LmdError
from lmd.lite.awq_accuracy import DEFAULT_ITEMS, DEFAULT_TASKS
from lmd.lite.awq_methods import DEFAULT_METHOD

if TYPE_CHECKING:
    import torch

    from lmd.calib_data import CalibSet


def awq_command(
    model: str = typer.Argument(..., help="HF model directory, .gguf file or hub id."),
    work_dir: str = typer.Option(..., "--work-dir", help="Output directory for the quantized HF model."),
    method: str = typer.Option(
        DEFAULT_METHOD,
        "--method",
        help="awq-gptq (the default: AWQ's scales and clipped grid, codes chosen by GPTQ's error feedback), "
        "awq (scale search + clip search, round to nearest), "
        "autoround (AWQ's scales, then rounding and clipping learned per block against the float block's output "
        "by signed gradient descent) or rtn (plain round to nearest).",
    ),
    w_bits: int = typer.Option(4, "--w-bits", help="Weight bits (only 4)."),
    w_group_size: int = typer.Option(128, "--w-group-size", help="Input channels per quantization group: 128, 64 or 32."),
    calib_dataset: str = typer.Option(
        "pileval",
        "--calib-dataset",
        help="pileval (falls back to c4 when unavailable), c4, ptb, wikitext2, pydoc or a path.",
    ),
    calib_samples: int = typer.Option(128, "--calib-samples", help="Calibration sequences."),
    calib_seqlen: int = typer.Option(512, "--calib-seqlen", help="Tokens per calibration sequence."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (one decoder layer at a time lives there)."),
    batch_size: int = typer.Option(16, "--batch-size", help="Calibration sequences per forward."),
    no_search_scale: bool = typer.Option(False, "--no-search-scale", help="Skip the activation-aware scale search."),
    no_clip: bool = typer.Option(False, "--no-clip", help="Skip the weight clipping search (both off = plain RTN)."),
    duo_scaling: str = typer.Option(
        "on",
        "--duo-scaling",
        help="Scale candidates: on (x^a / w^(1-a), AutoAWQ), off (x^a, llm-awq), auto (both grids, lowest loss wins).",
    ),
    search_tokens: int = typer.Option(
        4096,
        "--search-tokens",
        help="Token rows the scale search re-runs each module on (0 = all); x_mean always uses every calibration token.",
    ),
    gqa_v_o: bool = typer.Option(
        False,
        "--gqa-v-o/--no-gqa-v-o",
        help="Also search v -> o scales under GQA (AutoAWQ skips them): one scale per v "
        "channel, shared by the query heads that read it.",
    ),
    asym_clip: bool = typer.Option(
        False,
        "--asym-clip",
        help="Beyond AWQ: the clip search shrinks the top and the bottom of each group's "
        "range separately (10 x 10 low/high pairs plus the symmetric limits) instead of one symmetric limit.",
    ),
    refine_scale: bool = typer.Option(
        False,
        "--refine-scale",
        help="Beyond AWQ: after clipping, fit each group's fp16 scale and integer zero "
        "point to the output error d^T H d (H: the group's input Gram matrix over "
        "all calibration tokens).",
    ),
    gptq: bool = typer.Option(
        False,
        "--gptq",
        help="Beyond AWQ: choose the codes with GPTQ's error feedback (inverse Hessian of the "
        "inputs, act-order, damp 0.01) on the AWQ grid; the same AutoAWQ format.",
    ),
    quantized_inputs: bool = typer.Option(
        False,
        "--quantized-inputs",
        help="Calibrate each block on the outputs of the already quantized blocks "
        "before it (as GPTQ does) instead of the float model's.",
    ),
    autoround_iters: int | None = typer.Option(
        None, "--autoround-iters", help="--method autoround: signed-gradient steps per block (default 20)."
    ),
    autoround_batch: int | None = typer.Option(
        None, "--autoround-batch", help="--method autoround: calibration sequences per step (default 1)."
    ),
    eval_dataset: str = typer.Option("wikitext2", "--eval-dataset", help="Data set of the fp-vs-int4 ppl report."),
    eval_windows: int = typer.Option(4, "--eval-windows", help="Windows of the ppl report (0 = all)."),
    eval_seqlen: int = typer.Option(2048, "--eval-seqlen", help="Tokens per ppl window."),
    eval_tasks: str = typer.Option(
        DEFAULT_TASKS, "--eval-tasks", help="Zero-shot tasks of the report's accuracy line (as lmd eval tasks)."
    ),
    eval_items: int = typer.Option(DEFAULT_ITEMS, "--eval-items", help="Items per task of the accuracy line."),
    no_eval: bool = typer.Option(False, "--no-eval", help="Skip the quality report (ppl and accuracy)."),
    no_eval_fp: bool = typer.Option(False, "--no-eval-fp", help="Skip only the float baseline of the report."),
    data_dir: str | None = typer.Option(
        None, "--data-dir", help="Local data mirror laid out like ../shared/data (default $LMD_DATA_DIR)."
    ),
    seed: int = typer.Option(0, "--seed", help="Calibration sampling seed."),
    force: bool = typer.Option(False, "--force", help="Overwrite a non-empty --work-dir."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """AWQ int4 (asymmetric, per group) weight quantization, layer by layer; writes an AutoAWQ gemm HF directory."""
    import torch

    from lmd import __version__
    from lmd.arch import get_arch
    from lmd.lite.awq import AwqConfig, check_group_size
    from lmd.lite.awq_accuracy import accuracy, load_probe
    from lmd.lite.awq_export import write_awq_model
    from lmd.lite.awq_methods import method_fields
    from lmd.lite.llama_view import as_llama, llama_config, needs_llama_view
    from lmd.lite.output_dir import atomic_output_dir, check_output_dir
    from lmd.model_source import check_device, load_causal_lm, load_config, load_tokenizer, resolve_model

    preset = method_fields(method)
    given = (("sign_round_iters", autoround_iters), ("sign_round_batch", autoround_batch))
    tuning = {field: value for field, value in given if value is not None}
    if tuning and not preset.sign_round:
        raise LmdError(f"--autoround-iters/--autoround-batch apply to --method autoround only, not --method {method}")
    config = AwqConfig(
        w_bits=w_bits,
        group_size=w_group_size,
        search_scale=preset.search_scale and not no_search_scale,
        clip=preset.clip and not no_clip,
        duo_scaling=duo_scaling,
        search_tokens=search_tokens,
        gqa_v_o=gqa_v_o,
        asym_clip=asym_clip,
        refine_scale=refine_scale,
        gptq=preset.gptq or gptq,
        quantized_inputs=quantized_inputs,
        sign_round=preset.sign_round,
        **tuning,
        batch_size=batch_size,
        device=check_device(device),
    )
    if eval_windows < 0:
        raise LmdError(f"--eval-windows {eval_windows} must be 0 (all) or more")
    check_output_dir(work_dir, force)
    probe = None if no_eval else load_probe(eval_tasks, eval_items, data_dir)  # task files checked before the model
    source = resolve_model(model)
    model_config = load_config(source)
    if needs_llama_view(model_config):
        llama_config(model_config)  # a model lite cannot run as Llama fails before it loads
    tokenizer = load_tokenizer(source)
    lm = as_llama(load_causal_lm(source, dtype="float32", device="cpu"))  # Phi-3: its Llama view (llama_view.py)
    arch = get_arch(lm.config)
    check_group_size(lm, arch, config.group_size)
    report: dict[str, Any] = {
        "model": source.display_name,
        "work_dir": work_dir,
        "method": config.method,
        **asdict(config),
    }
    if not config.calibrated:  # round-to-nearest reads no activations
        input_ids = torch.zeros(0, dtype=torch.long)
        report.update(calib_dataset="none", calib_split="", calib_samples=0, calib_seqlen=0)
    else:
        calib = _calibration_set(calib_dataset, tokenizer, calib_samples, calib_seqlen, seed, data_dir)
        input_ids = calib.input_ids
        report.update(
            calib_dataset=calib.dataset,
            calib_split=calib.split,
            calib_source=calib.source,
            calib_samples=calib.nsamples,
            calib_seqlen=calib.seqlen,
            seed=seed,
        )
    eval_ids, eval_label = (None, "") if no_eval else _eval_ids(eval_dataset, tokenizer, data_dir)
    if eval_ids is not None and not no_eval_fp:
        report["fp_ppl"] = _ppl(lm, eval_ids, eval_seqlen, eval_windows, config.device, json_out).ppl
    if probe is not None and not no_eval_fp:
        report["fp_acc"] = accuracy(lm, tokenizer, probe, config.device, "fp", json_out)

    start = time.perf_counter()
    with torch.no_grad():
        quantized = _quantize_with_progress(lm, input_ids, config, quiet=json_out)
    report["quantize_seconds"] = round(time.perf_counter() - start, 1)

    if eval_ids is not None:
        result = _ppl(lm, eval_ids, eval_seqlen, eval_windows, config.device, json_out)
        report.update(int4_ppl=result.ppl, eval_dataset=eval_label, eval_windows=result.windows, eval_seqlen=eval_seqlen)
    if probe is not None:
        report.update(int4_acc=accuracy(lm, tokenizer, probe, config.device, "int4", json_out), eval_items=eval_items)
    report["lmd_version"] = __version__
    with atomic_output_dir(work_dir, force) as tmp:
        write_awq_model(lm, quantized, tokenizer, tmp, config.group_size, report)
    if json_out:
        typer.echo(json.dumps(report))
    else:
        _print_report(report)


def _calibration_set(dataset: str, tokenizer, nsamples: int, seqlen: int, seed: int, data_dir: str | None) -> CalibSet:
    from lmd.calib_data import get_calib_samples
    from lmd.calib_data.sources import say

    try:
        return get_calib_samples(dataset, tokenizer, nsamples, seqlen, seed=seed, data_dir=data_dir)
    except LmdError:
        if dataset != "pileval":
            raise
        say("pileval is not available (no local mirror file, hub unreachable); calibrating on c4 (train) instead")
    return get_calib_samples("c4", tokenizer, nsamples, seqlen, seed=seed, data_dir=data_dir)


def _eval_ids(dataset: str, tokenizer, data_dir: str | None) -> tuple[torch.Tensor, str]:
    from lmd.calib_data import load_eval_text
    from lmd.calib_data.tokenization import encode

    text = load_eval_text(dataset, "test", data_dir)
    return encode(tokenizer, text.text), f"{text.dataset} ({text.split})"


def _ppl(lm, ids: torch.Tensor, seqlen: int, windows: int, device: str, quiet: bool):
    from lmd.eval.ppl import hf_window_scorer, perplexity

    lm.to(device)
    try:
        return perplexity(
            hf_window_scorer(lm, device), ids, seqlen=seqlen, max_windows=windows or None, progress=not quiet
        )
    finally:
        lm.to("cpu")


def _quantize_with_progress(lm, input_ids: torch.Tensor, config, quiet: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from lmd.lite.awq import quantize_model

    layers = lm.config.num_hidden_layers
    columns = (
        TextColumn(f"{config.method} w4 g{config.group_size}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), disable=quiet, transient=True) as bar:
        task = bar.add_task("layers", total=layers, note="capturing layer 0 inputs")

        def on_layer(report) -> None:
            gain = [f"{1 - r.loss / r.rtn_loss:+.0%}" for r in report.scales if r.rtn_loss > 0]
            note = f"layer {report.index}: loss vs RTN " + " ".join(gain) if gain else f"layer {report.index}"
            bar.update(task, advance=1, note=note)

        return quantize_model(lm, input_ids, config, on_layer)


def _print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"lmd awq: {report['method']} w4 g{report['group_size']}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    calib = (
        f"{report['calib_dataset']} ({report['calib_split']}) {report['calib_samples']} x {report['calib_seqlen']}"
        if report["calib_samples"]
        else "none (RTN)"
    )
    rows = [
        ("model", report["model"]),
        ("output", report["work_dir"]),
        ("calibration", calib),
        ("quantize time", f"{report['quantize_seconds']:.1f} s"),
    ]
    if "int4_ppl" in report:
        q = report["int4_ppl"]
        rows.append(("eval", f"{report['eval_dataset']}, {report['eval_windows']} x {report['eval_seqlen']} tokens"))
        if "fp_ppl" in report:
            rows += [("fp ppl", f"{report['fp_ppl']:.4f}"), ("int4 ppl", f"{q:.4f} ({q - report['fp_ppl']:+.4f})")]
        else:
            rows.append(("int4 ppl", f"{q:.4f}"))
    if "int4_acc" in report:
        from lmd.lite.awq_accuracy import accuracy_row

        rows.append((f"accuracy, first {report['eval_items']}", accuracy_row(report.get("fp_acc"), report["int4_acc"])))
    for field, value in rows:
        table.add_row(field, value)
    Console().print(table)
