"""Flags shared by the `lmd bench` commands: the prompt workload (throughput and serve), outputs, and value lists."""

from __future__ import annotations

from typing import Annotated

import typer

from lmd.errors import LmdError

Dataset = Annotated[
    str,
    typer.Option(
        "--dataset",
        help="sharegpt (<data dir>/sharegpt/*.json), random (synthetic token ids), or a ShareGPT-format "
        ".json/.jsonl file or directory.",
    ),
]
DataDir = Annotated[
    str | None, typer.Option("--data-dir", help="Data directory holding sharegpt/ (default $LMD_DATA_DIR).")
]
NumPrompts = Annotated[int, typer.Option("--num-prompts", help="Requests to run.")]
MaxOutputLen = Annotated[
    int,
    typer.Option(
        "--max-output-len", help="Cap on tokens per reply; prompts without a reference reply may stop earlier at EOS."
    ),
]
FixedOutputLen = Annotated[
    int | None,
    typer.Option("--fixed-output-len", help="Every request generates exactly this many tokens (EOS ignored)."),
]
MinInputLen = Annotated[int, typer.Option("--min-input-len", help="Skip shorter prompts (tokens).")]
MaxInputLen = Annotated[int, typer.Option("--max-input-len", help="Skip longer prompts (tokens).")]
RandomInputLen = Annotated[
    int,
    typer.Option(
        "--random-input-len", help="Prompt tokens with --dataset random (output: --fixed-output-len or --max-output-len)."
    ),
]
RawPrompts = Annotated[
    bool, typer.Option("--raw-prompts", help="Tokenize prompts as plain text, without the chat template.")
]
Temperature = Annotated[float, typer.Option("--temperature", help="0: greedy; > 0 samples the whole vocabulary.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the prompt sample (and of sampling, --temperature > 0).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the report as JSON instead of a table.")]
Plot = Annotated[
    str | None,
    typer.Option(
        "--plot",
        metavar="FILE.png",
        help="Also draw output tok/s, TTFT p50/p99 and TPOT p50/p99 against concurrency into this image "
        "(.png, .svg or .pdf), beside every --baseline.",
    ),
]
Baseline = Annotated[
    list[str] | None,
    typer.Option(
        "--baseline",
        metavar="[LABEL=]RESULT.json",
        help="A result file to draw beside this run in --plot (repeatable): an lmd --save-result or --json file, "
        "or a vLLM / SGLang bench result; files with the same label form one series.",
    ),
]
SaveResult = Annotated[
    str | None,
    typer.Option("--save-result", metavar="FILE.json", help="Write the report (the --json object) to this file."),
]
Label = Annotated[
    str | None,
    typer.Option("--label", help="Name of this run in --plot and in the saved result (default: see lmd bench docs)."),
]
Force = Annotated[bool, typer.Option("--force", help="Overwrite existing --plot / --save-result files.")]


def check_temperature(temperature: float) -> None:
    if not 0.0 <= temperature <= 2.0:
        raise LmdError(f"--temperature {temperature} is outside [0, 2]; use 0 for greedy")


def parse_int_list(values: list[str], flag: str, low: int = 1) -> tuple[int, ...]:
    """Whole numbers from repeated flags and comma lists (`--flag 1,8 --flag 32`), de-duplicated, in order."""
    out = []
    for value in values:
        for part in value.split(","):
            try:
                number = int(part)
            except ValueError:
                raise LmdError(f"{flag} {value!r} is not a whole number or a comma list of them (e.g. 1,8,32)") from None
            if number < low:
                raise LmdError(f"{flag} values must be at least {low} (got {number})")
            out.append(number)
    return tuple(dict.fromkeys(out))
