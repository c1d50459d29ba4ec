"""`lmd bench throughput|latency`: offline engine benchmarks (LMDeploy's profile_throughput / profile_generation);
`lmd bench serve` (HTTP) lives in serve_command.py and is registered here."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from lmd.bench.cli_options import (
    AsJson,
    Baseline,
    DataDir,
    Dataset,
    FixedOutputLen,
    Force,
    Label,
    MaxInputLen,
    MaxOutputLen,
    MinInputLen,
    NumPrompts,
    Plot,
    RandomInputLen,
    RawPrompts,
    SaveResult,
    Seed,
    Temperature,
    check_temperature,
    parse_int_list,
)
from lmd.bench.progress import progress_bar
from lmd.bench.serve_command import serve_command
from lmd.engine_options import (
    CacheBlockSeqLenOpt,
    CacheMaxEntryCountOpt,
    DtypeOpt,
    EnforceEagerOpt,
    MaxBatchSizeOpt,
    NumSpeculativeTokensOpt,
    OffloadWeightsOpt,
    PpOpt,
    QuantPolicyOpt,
    SessionLenOpt,
    SpeculativeMethodOpt,
    SpeculativeModelOpt,
    SpeculativeTreeOpt,
    TpOpt,
)

if TYPE_CHECKING:
    from lmd.bench.engine_setup import EngineOverrides

bench_app = typer.Typer(
    help="Benchmark the engine (throughput over a prompt set, latency at fixed lengths) or any OpenAI-compatible "
    "server over HTTP (serve).",
    no_args_is_help=True,
)

ModelArg = Annotated[
    str,
    typer.Argument(
        metavar="WORKSPACE_OR_MODEL",
        help="An lmd workspace, or an HF directory / .gguf file (deployed into a temporary workspace first).",
    ),
]
ModelName = Annotated[
    str, typer.Option("--model-name", help="Chat template when MODEL is deployed first (see lmd deploy).")
]
Device = Annotated[str, typer.Option("--device", help="auto (cuda when available), cpu or cuda[:N].")]
MaxContext = Annotated[
    int | None, typer.Option("--max-context-token-num", help="Tokens computed per engine step (prefill budget).")
]


def _overrides(options: dict[str, Any], **changes: Any) -> EngineOverrides:
    """EngineOverrides from the command's own parameters (they share the field names), with `changes` applied."""
    from dataclasses import fields

    from lmd.bench.engine_setup import EngineOverrides

    return EngineOverrides(**{f.name: options[f.name] for f in fields(EngineOverrides)} | changes)


@bench_app.command("throughput")
def throughput_command(
    model: ModelArg,
    dataset: Dataset = "sharegpt",
    data_dir: DataDir = None,
    num_prompts: NumPrompts = 1000,
    concurrency: Annotated[
        list[str],
        typer.Option(
            "--concurrency",
            metavar="N[,N2,...]",
            help="Most requests in flight at once; a comma list (1,8,32) or repeated flag runs the workload once per "
            "value on the same engine.",
        ),
    ] = ["64"],  # noqa: B006
    max_output_len: MaxOutputLen = 256,
    fixed_output_len: FixedOutputLen = None,
    min_input_len: MinInputLen = 4,
    max_input_len: MaxInputLen = 1024,
    random_input_len: RandomInputLen = 128,
    raw_prompts: RawPrompts = False,
    temperature: Temperature = 0.0,
    seed: Seed = 0,
    model_name: ModelName = "hf",
    device: Device = "auto",
    dtype: DtypeOpt = "auto",
    max_batch_size: MaxBatchSizeOpt = None,
    session_len: SessionLenOpt = None,
    max_context_token_num: MaxContext = None,
    cache_max_entry_count: CacheMaxEntryCountOpt = None,
    cache_block_seq_len: CacheBlockSeqLenOpt = None,
    quant_policy: QuantPolicyOpt = None,
    tp: TpOpt = None,
    pp: PpOpt = None,
    enforce_eager: EnforceEagerOpt = False,
    offload_weights_gb: OffloadWeightsOpt = None,
    speculative_method: SpeculativeMethodOpt = None,
    speculative_model: SpeculativeModelOpt = None,
    num_speculative_tokens: NumSpeculativeTokensOpt = None,
    speculative_tree: SpeculativeTreeOpt = None,
    label: Label = None,
    save_result: SaveResult = None,
    plot: Plot = None,
    baseline: Baseline = None,
    force: Force = False,
    as_json: AsJson = False,
) -> None:
    """Offline throughput: NUM_PROMPTS requests, at most CONCURRENCY in flight (once per value of a list);
    requests/s, tokens/s, TTFT, TPOT."""
    from lmd.bench.outputs import prepare_outputs, write_outputs
    from lmd.bench.sampling import SamplingConfig
    from lmd.bench.workload import build_requests, engine_codec, read_prompt_source, workload_settings

    levels = parse_int_list(concurrency, "--concurrency")
    check_temperature(temperature)
    sampling = SamplingConfig(num_prompts, seed, min_input_len, max_input_len, max_output_len, fixed_output_len)
    overrides = _overrides(locals())
    outputs = prepare_outputs(save_result, plot, baseline, force)
    source = read_prompt_source(dataset, data_dir, random_input_len)
    from lmd.bench.engine_setup import engine_facts, open_engine

    with open_engine(model, model_name, overrides) as pipe:
        engine = pipe.engine
        room = (engine.max_len, "--session-len")
        requests = build_requests(engine_codec(engine), source, sampling, not raw_prompts, room)
        settings = engine_facts(engine, model) | workload_settings(source, sampling, not raw_prompts, temperature)
        from lmd.bench.report import print_throughput, throughput_sweep_report
        from lmd.bench.throughput import run_throughput

        with progress_bar("bench throughput", not as_json) as bar:
            task = bar.add_task("requests", total=len(requests) * len(levels))
            runs = [
                run_throughput(engine, requests, level, temperature, seed, lambda _: bar.advance(task))
                for level in levels
            ]
    name = label or "lmd"
    report = throughput_sweep_report(runs, settings, name)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        print_throughput(report)
    write_outputs(outputs, report, name, f"lmd engine, {model}: {dataset}, {len(requests)} requests")


@bench_app.command("latency")
def latency_command(
    model: ModelArg,
    input_len: Annotated[int, typer.Option("--input-len", help="Prompt tokens (random ids) per request.")] = 128,
    output_len: Annotated[
        int, typer.Option("--output-len", help="Tokens generated per request, exactly (EOS ignored).")
    ] = 128,
    batch_size: Annotated[
        list[str],
        typer.Option("--batch-size", help="Requests submitted together; repeat the flag or give a comma list (1,8,32)."),
    ] = ["1"],  # noqa: B006
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed iterations per batch size.")] = 1,
    iters: Annotated[int, typer.Option("--iters", help="Timed iterations per batch size.")] = 3,
    seed: Seed = 0,
    model_name: ModelName = "hf",
    device: Device = "auto",
    dtype: DtypeOpt = "auto",
    max_batch_size: Annotated[
        int | None,
        typer.Option("--max-batch-size", help="Engine's max running requests (default: the largest --batch-size)."),
    ] = None,
    session_len: SessionLenOpt = None,
    max_context_token_num: MaxContext = None,
    cache_max_entry_count: CacheMaxEntryCountOpt = None,
    cache_block_seq_len: CacheBlockSeqLenOpt = None,
    quant_policy: QuantPolicyOpt = None,
    tp: TpOpt = None,
    pp: PpOpt = None,
    enforce_eager: EnforceEagerOpt = False,
    offload_weights_gb: OffloadWeightsOpt = None,
    speculative_method: SpeculativeMethodOpt = None,
    speculative_model: SpeculativeModelOpt = None,
    num_speculative_tokens: NumSpeculativeTokensOpt = None,
    speculative_tree: SpeculativeTreeOpt = None,
    as_json: AsJson = False,
) -> None:
    """Latency at fixed lengths per batch size: time to first token, decode ms per token, tokens/s."""
    from lmd.bench.latency import LatencyConfig, check_fits, run_latency

    config = LatencyConfig(input_len, output_len, parse_int_list(batch_size, "--batch-size"), warmup, iters, seed)
    overrides = _overrides(locals(), max_batch_size=max_batch_size or max(config.batch_sizes))
    from lmd.bench.engine_setup import engine_facts, open_engine
    from lmd.bench.report import latency_report, print_latency

    with open_engine(model, model_name, overrides) as pipe:
        settings = {
            **engine_facts(pipe.engine, model),
            "input_len": input_len,
            "output_len": output_len,
            "batch_sizes": list(config.batch_sizes),
            "warmup": warmup,
            "iters": iters,
            "seed": seed,
        }
        check_fits(config, pipe.engine.max_len, pipe.engine.workspace.engine.max_batch_size)
        total = len(config.batch_sizes) * (warmup + iters)
        with progress_bar("bench latency", not as_json) as bar:
            task = bar.add_task("iterations", total=total)
            results = run_latency(pipe.engine, config, lambda: bar.advance(task))
    report = latency_report(results, settings)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        print_latency(report)


bench_app.command("serve")(serve_command)
