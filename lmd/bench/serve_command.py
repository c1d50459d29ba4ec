"""`lmd bench serve URL`: `lmd bench throughput`'s workloads sent to any OpenAI-compatible server over HTTP, streamed,
at a request rate and one or more concurrency limits (vLLM's `bench serve`, SGLang's `bench_serving`)."""

from __future__ import annotations

import dataclasses
import json
import math
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
from lmd.errors import LmdError

if TYPE_CHECKING:
    from lmd.bench.sampling import BenchRequest
    from lmd.bench.serve_run import LoadConfig, ServeTarget
    from lmd.bench.workload import PromptCodec


def serve_command(
    url: Annotated[
        str,
        typer.Argument(
            metavar="URL", help="Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:23333 (/v1 optional)."
        ),
    ],
    model: Annotated[
        str | None, typer.Option("--model", help="Model name to request (default: the first one of /v1/models).")
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            help="Tokenizer that builds the prompts: the served workspace (its chat template too), an HF directory, "
            ".gguf or hub id (default: --model, when it is one of those).",
        ),
    ] = None,
    endpoint: Annotated[
        str,
        typer.Option(
            "--endpoint",
            help="/v1/completions (prompts sent as token ids) or /v1/chat/completions (text, the server's template).",
        ),
    ] = "/v1/completions",
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="OPENAI_API_KEY", help="Bearer token, if the server wants one.")
    ] = None,
    max_concurrency: Annotated[
        list[str] | None,
        typer.Option(
            "--max-concurrency",
            metavar="N[,N2,...]",
            help="Most requests in flight; a comma list (1,8,32) or repeated flag runs the workload once per value "
            "(default: no limit).",
        ),
    ] = None,
    request_rate: Annotated[
        float, typer.Option("--request-rate", help="Requests sent per second on average; inf sends all at once.")
    ] = math.inf,
    burstiness: Annotated[
        float,
        typer.Option("--burstiness", help="Shape of the gaps between requests: 1 Poisson, < 1 burstier, > 1 steadier."),
    ] = 1.0,
    dataset: Dataset = "sharegpt",
    data_dir: DataDir = None,
    num_prompts: NumPrompts = 1000,
    max_output_len: MaxOutputLen = 256,
    fixed_output_len: FixedOutputLen = None,
    min_input_len: MinInputLen = 4,
    max_input_len: MaxInputLen = 1024,
    random_input_len: RandomInputLen = 128,
    raw_prompts: RawPrompts = False,
    temperature: Temperature = 0.0,
    seed: Seed = 0,
    request_timeout: Annotated[
        float, typer.Option("--request-timeout", help="Seconds one request may take before it counts as failed.")
    ] = 600.0,
    label: Label = None,
    save_result: SaveResult = None,
    plot: Plot = None,
    baseline: Baseline = None,
    force: Force = False,
    as_json: AsJson = False,
) -> None:
    """Serving benchmark over HTTP: streamed requests at --request-rate, once per --max-concurrency; TTFT, TPOT, ITL,
    E2E latency percentiles, requests/s and tokens/s."""
    from lmd.bench.outputs import prepare_outputs, write_outputs
    from lmd.bench.sampling import SamplingConfig
    from lmd.bench.serve_run import LoadConfig, ServeTarget
    from lmd.bench.server_probe import base_url, served_model
    from lmd.bench.workload import build_requests, read_prompt_source, workload_settings

    check_temperature(temperature)
    levels = parse_int_list(max_concurrency, "--max-concurrency") if max_concurrency else (None,)
    load = LoadConfig(levels, request_rate, burstiness, temperature, seed)
    sampling = SamplingConfig(num_prompts, seed, min_input_len, max_input_len, max_output_len, fixed_output_len)
    target = ServeTarget(base_url(url), endpoint, model or "", api_key, request_timeout)
    if raw_prompts and target.chat:
        raise LmdError("--raw-prompts applies to /v1/completions; chat requests always go through the server's template")
    outputs = prepare_outputs(save_result, plot, baseline, force)
    source = read_prompt_source(dataset, data_dir, random_input_len)

    served = served_model(target.base_url, model, target.headers, request_timeout)
    target = dataclasses.replace(target, model=served.id)
    codec = _codec(tokenizer, served.id)

    room = None if served.max_model_len is None else (served.max_model_len, "the server's max_model_len")
    chat = target.chat or not raw_prompts
    requests = build_requests(codec, source, sampling, chat, room)
    settings = {
        "url": target.base_url,
        "endpoint": endpoint,
        "model": served.id,
        "tokenizer": tokenizer or served.id,
        **workload_settings(source, sampling, chat, temperature),
        "request_rate": request_rate if math.isfinite(request_rate) else None,
        "burstiness": burstiness,
        "max_concurrency": list(levels),
    }
    report = _run(target, requests, codec, load, settings, label or served.owned_by or "server", as_json)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        from lmd.bench.serve_report import print_serve

        print_serve(report)
    title = f"{served.id} at {target.base_url}: {dataset}, {num_prompts} requests"
    write_outputs(outputs, report, report["label"], title)


def _codec(tokenizer: str | None, served: str) -> PromptCodec:
    from lmd.bench.workload import tokenizer_codec

    if tokenizer is not None:
        return tokenizer_codec(tokenizer)
    try:
        return tokenizer_codec(served)
    except LmdError:
        raise LmdError(
            f"the served model name {served!r} is not a tokenizer lmd can load; pass --tokenizer "
            "(the served workspace, HF directory, .gguf file or hub id)"
        ) from None


def _run(
    target: ServeTarget,
    requests: list[BenchRequest],
    codec: PromptCodec,
    load: LoadConfig,
    settings: dict[str, Any],
    label: str,
    quiet: bool,
) -> dict[str, Any]:
    from lmd.bench.progress import progress_bar
    from lmd.bench.serve_report import serve_report
    from lmd.bench.serve_run import request_body, run_serve
    from lmd.bench.workload import prompt_text

    bodies = [
        request_body(target, r, lambda r=r: prompt_text(codec, r), load.temperature, load.seed + i)
        for i, r in enumerate(requests)
    ]
    with progress_bar("bench serve", not quiet) as bar:
        task = bar.add_task("requests", total=len(requests) * len(load.max_concurrency))
        runs = run_serve(target, requests, bodies, load, lambda _: bar.advance(task))
    report = serve_report(runs, settings, label)
    if not any(run["completed"] for run in report["runs"]):
        first = next(iter(report["runs"][0]["errors"]))
        raise LmdError(f"every request to {target.url} failed, e.g. {first}; see the server's log")
    return report
