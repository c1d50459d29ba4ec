"""Flags shared by `lmd chat`, `gradio`, `serve` and `bench`: the model, sampling, engine overrides, the servers'
address, and opening the engine.

MODEL may be a workspace or anything `lmd deploy` reads; the latter is deployed into a temporary workspace by
`lmd.pipeline`, exactly as the Python API does, and removed when the command ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer

from lmd.errors import LmdError

if TYPE_CHECKING:
    from lmd.turbomind.engine import Engine
    from lmd.turbomind.engine_core import EngineClient
    from lmd.turbomind.gen_config import GenerationConfig

ModelArg = Annotated[
    str,
    typer.Argument(
        help="An lmd workspace (from `lmd deploy`), or an HF model directory / .gguf file / hub id, deployed into a "
        "temporary workspace first.",
        metavar="MODEL",
        show_default=False,
    ),
]
ModelNameOpt = Annotated[
    str | None,
    typer.Option(
        "--model-name",
        help="Chat template when MODEL is not a workspace: llama2, llama3, vicuna, internlm, qwen, mistral, "
        "base or hf (the tokenizer's own; the default). A workspace keeps the one it was deployed with.",
    ),
]
SystemOpt = Annotated[
    str | None,
    typer.Option(
        "--system", help="System prompt that opens every conversation (default: the chat template's own, if any)."
    ),
]

TemperatureOpt = Annotated[float, typer.Option("--temperature", help="Sampling temperature in [0, 2]; 0 = greedy.")]
TopPOpt = Annotated[
    float,
    typer.Option(
        "--top-p", help="Nucleus sampling: keep the most likely tokens up to this probability mass, in (0, 1]; 1 = off."
    ),
]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Sample among the K most likely tokens; 0 = off, 1 = greedy.")]
RepetitionPenaltyOpt = Annotated[
    float, typer.Option("--repetition-penalty", help="> 1 discourages tokens already in the conversation; 1 = off.")
]
MaxNewTokensOpt = Annotated[int, typer.Option("--max-new-tokens", help="Longest reply, in tokens.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Sampling seed, for replies that repeat run to run.")]

SessionLenOpt = Annotated[
    int | None,
    typer.Option(
        "--session-len", help="Tokens one conversation may hold, prompts and replies together (default: config.ini's)."
    ),
]
CacheMaxEntryCountOpt = Annotated[
    float | None,
    typer.Option(
        "--cache-max-entry-count",
        help="KV cache size: a fraction of free device memory (<= 1) or a number of blocks "
        "(> 1) (default: config.ini's).",
    ),
]
CacheBlockSeqLenOpt = Annotated[
    int | None,
    typer.Option("--cache-block-seq-len", help="Tokens per KV block, the prefix cache's unit (default: config.ini's)."),
]
QuantPolicyOpt = Annotated[
    int | None, typer.Option("--quant-policy", help="KV cache: 0 = the compute dtype, 4 = int8 (default: config.ini's).")
]
MaxBatchSizeOpt = Annotated[
    int | None, typer.Option("--max-batch-size", help="Replies generated at once (default: config.ini's).")
]
NoPrefixCachingOpt = Annotated[
    bool,
    typer.Option(
        "--no-enable-prefix-caching",
        help="Compute every prompt in full instead of reusing the KV cache of prefixes (whole blocks) that earlier "
        "requests computed, such as a chat's history or a shared system prompt (reuse is on by default; vLLM's flag).",
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto (cuda when available), cuda or cpu.")]
OffloadWeightsOpt = Annotated[
    float | None,
    typer.Option(
        "--offload-weights",
        metavar="GB",
        help="Free this many GiB of device memory (per GPU) by keeping decoder-layer weights in host memory, copied "
        "to the GPU ahead of each layer's use (a model larger than the GPU runs, slower; the KV cache gets the "
        "memory freed). Default: none.",
    ),
]
TpOpt = Annotated[
    int | None,
    typer.Option(
        "--tp",
        help="Tensor parallelism: N processes (rank r on cuda:r, or CPU), any N dividing the query heads, KV heads "
        "and MLP width, whatever TP the workspace was deployed with (its rank files are read as they are when N "
        "matches, else split or merged at load); 1 (the default) runs the whole model in one process.",
    ),
]
PpOpt = Annotated[
    int | None,
    typer.Option(
        "--pp",
        help="Pipeline parallelism: the decoder layers cut into N stages of consecutive layers, each in its own "
        "process(es) (tp x pp ranks in all: rank r on cuda:r, or CPU); every step's batch flows through the stages "
        "in micro-batches, so the stages compute at the same time. 1 (the default): no pipeline.",
    ),
]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="Compute dtype: auto (the workspace's), fp32, fp16 or bf16.")]
EnforceEagerOpt = Annotated[
    bool,
    typer.Option(
        "--enforce-eager",
        help="Launch every decode step's kernels from Python instead of replaying CUDA graphs captured at start "
        "(graphs are the default on CUDA with pp 1; eager saves their start-up time and memory).",
    ),
]

SpeculativeMethodOpt = Annotated[
    str | None,
    typer.Option(
        "--speculative-method",
        help="Speculative decoding (greedy output unchanged, sampling's distribution unchanged): ngram (prompt "
        "lookup: propose what followed the last few tokens earlier in the prompt or reply) or draft (a smaller "
        "workspace, --speculative-model). Off by default.",
    ),
]
SpeculativeModelOpt = Annotated[
    str | None,
    typer.Option("--speculative-model", metavar="WORKSPACE",
                 help="The draft model of --speculative-method draft: an lmd workspace sharing MODEL's tokenizer."),
]
NumSpeculativeTokensOpt = Annotated[
    int | None,
    typer.Option("--num-speculative-tokens", metavar="K",
                 help="Most tokens proposed per step and verified in one forward (default 4)."),
]
SpeculativeTreeOpt = Annotated[
    str | None,
    typer.Option("--speculative-tree", metavar="BRANCHxDEPTH",
                 help="Verify a token tree instead of a chain: BRANCH candidates per depth (n-gram: that many "
                 "distinct earlier continuations; draft: its top BRANCH tokens, or BRANCH draws when sampling), DEPTH "
                 "tokens deep, all checked in one forward."),
]

# Servers (serve, gradio) take vLLM's spelling and LMDeploy's for the same two flags.
HostOpt = Annotated[
    str,
    typer.Option(
        "--host", "--server-name", help="Address to listen on: 0.0.0.0 every interface, 127.0.0.1 this machine only "
        "(--server-name is LMDeploy's spelling)."
    ),
]
PortOpt = Annotated[int, typer.Option("--port", "--server-port", help="TCP port to listen on (--server-port is "
                                      "LMDeploy's spelling).")]


def check_port(port: int) -> None:
    if not 0 < port < 65536:
        raise LmdError(f"--port {port} is not a TCP port; use 1..65535")


_SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens", "seed")
_ENGINE_FLAGS = (
    "session_len",
    "cache_max_entry_count",
    "cache_block_seq_len",
    "quant_policy",
    "max_batch_size",
    "device",
    "dtype",
    "tp",
    "pp",
    "offload_weights_gb",
)


def generation_config(**sampling: Any) -> GenerationConfig:
    """GenerationConfig from the sampling flags; an invalid value is reported under its flag name."""
    from lmd.turbomind.gen_config import GenerationConfig

    try:
        return GenerationConfig(**sampling)
    except LmdError as exc:
        message = str(exc)
        for name in _SAMPLING_FLAGS:
            message = message.replace(f"GenerationConfig.{name}=", f"--{name.replace('_', '-')} ")
        raise LmdError(message) from None


def with_sampling(config: GenerationConfig, **changes: Any) -> GenerationConfig:
    return dataclasses.replace(config, **changes)


def eager_overrides(enforce_eager: bool) -> dict[str, Any]:
    """The engine override of `--enforce-eager`: no decode CUDA graphs."""
    return {"cuda_graph": False} if enforce_eager else {}


def speculative_overrides(method: str | None, model: str | None = None, num_tokens: int | None = None,
                          tree: str | None = None) -> dict[str, Any]:
    """The engine option of the --speculative-* flags: {"speculative": SpeculativeConfig} or nothing."""
    if method is None:
        given = [flag for flag, value in (("--speculative-model", model), ("--num-speculative-tokens", num_tokens),
                                          ("--speculative-tree", tree)) if value is not None]
        if given:
            raise LmdError(f"{', '.join(given)} need --speculative-method ngram|draft")
        return {}
    from lmd.turbomind.speculative.config import SpeculativeConfig, parse_tree

    options: dict[str, Any] = {"model": model, "tree": None if tree is None else parse_tree(tree)}
    if num_tokens is not None:
        options["num_speculative_tokens"] = num_tokens
    return {"speculative": SpeculativeConfig(method, **options)}


def split_flags(flags: dict[str, Any]) -> tuple[GenerationConfig, dict[str, Any]]:
    """(sampling config, engine overrides) from a command's parameters; engine flags left unset keep config.ini's."""
    gen_config = generation_config(**{name: flags[name] for name in _SAMPLING_FLAGS})
    overrides = {name: flags[name] for name in _ENGINE_FLAGS if flags.get(name) is not None}
    speculative = speculative_overrides(flags.get("speculative_method"), flags.get("speculative_model"),
                                        flags.get("num_speculative_tokens"), flags.get("speculative_tree"))
    return gen_config, overrides | eager_overrides(bool(flags.get("enforce_eager"))) | speculative


def _torchrun_rank(model: str, overrides: dict[str, Any]) -> None:
    """Under torchrun (RANK/WORLD_SIZE set): check the launch against --tp x --pp; on ranks > 0 run this rank's part
    of the model until rank 0 stops, then exit (rank 0 goes on to drive the engine and serve)."""
    from lmd.turbomind.torchrun_env import check_world, torchrun_env
    from lmd.turbomind.workspace import is_workspace

    env = torchrun_env()
    if env is None:
        return
    check_world(env, int(overrides.get("tp") or 1), int(overrides.get("pp") or 1))
    if not is_workspace(model):
        raise LmdError(f"{model} is not a workspace; under torchrun every rank reads the same deployed workspace: "
                       "`lmd deploy` it first (on a path every node sees)")
    if env.rank == 0:
        return
    from dataclasses import fields

    from lmd.turbomind.config import EngineConfig
    from lmd.turbomind.torchrun_worker import run_torchrun_worker

    engine_keys = {f.name for f in fields(EngineConfig)}
    run_torchrun_worker(env, model, {k: v for k, v in overrides.items() if k in engine_keys})
    raise SystemExit(0)


@contextmanager
def open_chat_engine(model: str, model_name: str | None, overrides: dict[str, Any],
                     engine_process: bool = False) -> Iterator[Engine | EngineClient]:
    """The engine for MODEL (in a child process with `engine_process`), closed (and a temporary workspace removed)
    on exit."""
    from rich.console import Console

    from lmd.chat_templates import get_chat_template
    from lmd.turbomind.workspace import is_workspace

    _torchrun_rank(model, overrides)  # ranks > 0 of a torchrun launch run their part of the model and exit here
    if is_workspace(model):
        if model_name is not None:
            raise LmdError(
                f"{model} is a workspace: its chat template was fixed by `lmd deploy`; leave out "
                "--model-name or redeploy with another MODEL_NAME"
            )
        what = f"loading {model}"
    else:
        get_chat_template(model_name or "hf")  # a typo fails before the slow deploy
        what = f"deploying {model} into a temporary workspace (`lmd deploy` it once to skip this)"
    with Console(stderr=True).status(what):
        from lmd.api import Pipeline

        pipe = Pipeline(model, model_name or "hf", engine_process=engine_process, **overrides)
    try:
        yield pipe.engine
    finally:
        pipe.close()
