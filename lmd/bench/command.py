"""`lmd bench throughput|latency`: offline engine benchmarks (LMDeploy's profile_throughput / profile_generation)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from lmd.engine_options import (
    CacheBlockSeqLenOpt,
    CacheMaxEntryCountOpt,
    DtypeOpt,
    EnforceEagerOpt,
    MaxBatchSizeOpt,
    QuantPolicyOpt,
    SessionLenOpt,
    TpOpt,
)
from lmd.errors import LmdError

if TYPE_CHECKING:
    from rich.progress import Progress

    from lmd.bench.dataset import Conversation
    from lmd.bench.engine_setup import EngineOverrides
    from lmd.bench.sampling import BenchRequest, SamplingConfig
    from lmd.turbomind.engine import Engine

bench_app = typer.Typer(
    help="Benchmark the engine: throughput over a prompt set, latency at fixed lengths.", no_args_is_help=True
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
Seed = Annotated[int, typer.Option("--seed", help="Seed of the prompt sample (and of sampling, --temperature > 0).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the report as JSON instead of a table.")]


def _overrides(options: dict[str, Any], **changes: Any) -> EngineOverrides:
    """EngineOverrides from the command's own parameters (they share the field names), with `changes` applied."""
    from dataclasses import fields

    from lmd.bench.engine_setup import EngineOverrides

    return EngineOverrides(**{f.name: options[f.name] for f in fields(EngineOverrides)} | changes)


def _progress(label: str, enabled: bool) -> Progress:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn(f"[bold]{label}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not enabled,
    )


@bench_app.command("throughput")
def throughput_command(
    model: ModelArg,
    dataset: Annotated[
        str,
        typer.Option(
            "--dataset",
            help="sharegpt (<data dir>/sharegpt/*.json), random "
            "(synthetic token ids), or a ShareGPT-format "
            ".json/.jsonl file or directory.",
        ),
    ] = "sharegpt",
    data_dir: Annotated[
        str | None, typer.Option("--data-dir", help="Data directory holding sharegpt/ (default $LMD_DATA_DIR).")
    ] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="Requests to run.")] = 1000,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Most requests in flight at once.")] = 64,
    max_output_len: Annotated[
        int,
        typer.Option(
            "--max-output-len", help="Cap on tokens per reply; prompts without a reference reply may stop earlier at EOS."
        ),
    ] = 256,
    fixed_output_len: Annotated[
        int | None,
        typer.Option("--fixed-output-len", help="Every request generates exactly this many tokens (EOS ignored)."),
    ] = None,
    min_input_len: Annotated[int, typer.Option("--min-input-len", help="Skip shorter prompts (tokens).")] = 4,
    max_input_len: Annotated[int, typer.Option("--max-input-len", help="Skip longer prompts (tokens).")] = 1024,
    random_input_len: Annotated[
        int,
        typer.Option(
            "--random-input-len",
            help="Prompt tokens with --dataset random (output: --fixed-output-len or --max-output-len).",
        ),
    ] = 128,
    raw_prompts: Annotated[
        bool, typer.Option("--raw-prompts", help="Tokenize prompts as plain text, without the chat template.")
    ] = False,
    temperature: Annotated[
        float, typer.Option("--temperature", help="0: greedy; > 0 samples the whole vocabulary.")
    ] = 0.0,
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
    enforce_eager: EnforceEagerOpt = False,
    as_json: AsJson = False,
) -> None:
    """Offline throughput: NUM_PROMPTS requests, at most CONCURRENCY in flight; requests/s, tokens/s, TTFT, TPOT."""
    from lmd.bench.dataset import RANDOM, dataset_files, read_conversations
    from lmd.bench.sampling import SamplingConfig

    if concurrency < 1:
        raise LmdError(f"--concurrency must be at least 1 (got {concurrency})")
    if not 0.0 <= temperature <= 2.0:
        raise LmdError(f"--temperature {temperature} is outside [0, 2]; use 0 for greedy")
    if dataset == RANDOM and random_input_len < 1:
        raise LmdError(f"--random-input-len must be at least 1 (got {random_input_len})")
    sampling = SamplingConfig(num_prompts, seed, min_input_len, max_input_len, max_output_len, fixed_output_len)
    overrides = _overrides(locals())
    files = [] if dataset == RANDOM else dataset_files(dataset, data_dir)
    conversations = read_conversations(files) if files else []
    from lmd.bench.engine_setup import engine_facts, open_engine

    with open_engine(model, model_name, overrides) as pipe:
        engine = pipe.engine
        requests = _requests(engine, conversations, sampling, random_input_len, raw_prompts)
        settings = {
            **engine_facts(engine, model),
            "dataset": dataset,
            "files": [str(f) for f in files],
            "num_prompts": num_prompts,
            "seed": seed,
            "min_input_len": min_input_len,
            "max_input_len": max_input_len,
            "max_output_len": max_output_len,
            "fixed_output_len": fixed_output_len,
            "chat_template": not raw_prompts and dataset != RANDOM,
            "temperature": temperature,
        }
        if dataset == RANDOM:
            settings["random_input_len"] = random_input_len
        from lmd.bench.report import print_throughput, throughput_report
        from lmd.bench.throughput import run_throughput

        with _progress("bench throughput", not as_json) as bar:
            task = bar.add_task("requests", total=len(requests))
            run = run_throughput(engine, requests, concurrency, temperature, seed, lambda _: bar.advance(task))
    report = throughput_report(run, settings)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        print_throughput(report)


def _requests(
    engine: Engine, conversations: list[Conversation], sampling: SamplingConfig, random_input_len: int, raw: bool
) -> list[BenchRequest]:
    """Sampled dataset requests, or random ones when there are no conversations (--dataset random)."""
    import dataclasses

    from lmd.bench.engine_setup import random_token_space
    from lmd.bench.sampling import random_requests, sample_requests

    if not conversations:
        output_len = sampling.fixed_output_len or sampling.max_output_len
        if random_input_len + output_len > engine.max_len:
            raise LmdError(
                f"--random-input-len {random_input_len} + {output_len} output tokens exceeds the engine's "
                f"{engine.max_len} tokens per session; shorten them or raise --session-len"
            )
        vocab, banned = random_token_space(engine)
        return random_requests(sampling.num_prompts, random_input_len, output_len, vocab, sampling.seed, banned)
    tokenizer = engine.tokenizer
    return sample_requests(
        conversations,
        lambda text: engine.encode(text, apply_chat_template=not raw),
        lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
        dataclasses.replace(sampling, max_total_len=engine.max_len),
    )


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
    enforce_eager: EnforceEagerOpt = False,
    as_json: AsJson = False,
) -> None:
    """Latency at fixed lengths per batch size: time to first token, decode ms per token, tokens/s."""
    from lmd.bench.latency import LatencyConfig, check_fits, run_latency

    config = LatencyConfig(input_len, output_len, parse_batch_sizes(batch_size), warmup, iters, seed)
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
        with _progress("bench latency", not as_json) as bar:
            task = bar.add_task("iterations", total=total)
            results = run_latency(pipe.engine, config, lambda: bar.advance(task))
    report = latency_report(results, settings)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        print_latency(report)


def parse_batch_sizes(values: list[str]) -> tuple[int, ...]:
    sizes = []
    for value in values:
        for part in value.split(","):
            try:
                sizes.append(int(part))
            except ValueError:
                raise LmdError(
                    f"--batch-size {value!r} is not a whole number or a comma list of them (e.g. 1,8,32)"
                ) from None
    return tuple(dict.fromkeys(sizes))
