"""The `lmd serve` command: an engine with its step loop, behind the OpenAI-compatible app, run by uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from lmd.chat_templates import TOOL_FORMATS
from lmd.engine_options import (
    CacheBlockSeqLenOpt,
    CacheMaxEntryCountOpt,
    DeviceOpt,
    DtypeOpt,
    EnforceEagerOpt,
    HostOpt,
    MaxBatchSizeOpt,
    ModelArg,
    NoPrefixCachingOpt,
    NumSpeculativeTokensOpt,
    OffloadWeightsOpt,
    PortOpt,
    PpOpt,
    QuantPolicyOpt,
    SessionLenOpt,
    SpeculativeMethodOpt,
    SpeculativeModelOpt,
    SpeculativeTreeOpt,
    TpOpt,
    check_port,
)
from lmd.errors import LmdError
from lmd.serve.reasoning import REASONING_PARSERS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def serve_command(
    model: ModelArg,
    host: HostOpt = "0.0.0.0",
    port: PortOpt = 23333,
    model_name: Annotated[
        str | None,
        typer.Option(
            help="Name clients send as `model` and /v1/models lists (default: the workspace or model file name)."
        ),
    ] = None,
    api_keys: Annotated[
        list[str] | None,
        typer.Option(
            "--api-keys",
            envvar="LMD_API_KEYS",
            help="Accepted API key (repeat the flag for several; or LMD_API_KEYS, space-separated). Clients send "
            "'Authorization: Bearer KEY' to /v1/*. Default: no key needed.",
        ),
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(
            help="Chat template when MODEL is not a workspace: llama2, llama3, vicuna, internlm, qwen, mistral, base "
            "or hf (the tokenizer's own; the default). A workspace keeps the one it was deployed with."
        ),
    ] = None,
    session_len: SessionLenOpt = None,
    max_batch_size: MaxBatchSizeOpt = None,
    cache_max_entry_count: CacheMaxEntryCountOpt = None,
    cache_block_seq_len: CacheBlockSeqLenOpt = None,
    max_context_token_num: Annotated[
        int | None, typer.Option(help="Most tokens computed in one step, prefill chunks included (default: config.ini).")
    ] = None,
    quant_policy: QuantPolicyOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    tp: TpOpt = None,
    pp: PpOpt = None,
    enforce_eager: EnforceEagerOpt = False,
    offload_weights_gb: OffloadWeightsOpt = None,
    speculative_method: SpeculativeMethodOpt = None,
    speculative_model: SpeculativeModelOpt = None,
    num_speculative_tokens: NumSpeculativeTokensOpt = None,
    speculative_tree: SpeculativeTreeOpt = None,
    no_enable_prefix_caching: NoPrefixCachingOpt = False,
    disable_frontend_multiprocessing: Annotated[
        bool,
        typer.Option(
            "--disable-frontend-multiprocessing",
            help="Step the engine on a thread of the server's process instead of in a process of its own (vLLM's "
            "flag). The default, a separate engine process, keeps the HTTP and JSON work from delaying its steps.",
        ),
    ] = False,
    log_level: Annotated[str, typer.Option(help=f"uvicorn log level: {', '.join(LOG_LEVELS)}.")] = "info",
    tool_call_parser: Annotated[
        str | None,
        typer.Option(
            help=f"How replies write tool calls: {', '.join(TOOL_FORMATS)} (vLLM's names). Default: the chat "
            "template family's own format (qwen: hermes, llama3: llama3_json, mistral: mistral; hf: read from the "
            "tokenizer's template)."
        ),
    ] = None,
    reasoning_parser: Annotated[
        str | None,
        typer.Option(
            help=f"Move a thinking model's reasoning (<think> ... </think>) out of chat replies' content into "
            f"reasoning_content (streamed as delta.reasoning_content): {', '.join(REASONING_PARSERS)} (vLLM's names). "
            "Default: off, the reply is all content.",
        ),
    ] = None,
    otlp_traces_endpoint: Annotated[
        str | None,
        typer.Option(
            "--otlp-traces-endpoint",
            help="Export an OpenTelemetry span per generation request to this OTLP/HTTP collector (vLLM's flag), "
            "e.g. http://localhost:4318/v1/traces; a W3C traceparent header becomes its parent. Default: off.",
        ),
    ] = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics); see docs/serve.md."""
    check_port(port)
    if log_level not in LOG_LEVELS:
        raise LmdError(f"--log-level {log_level} is unknown; use one of {', '.join(LOG_LEVELS)}")
    if tool_call_parser is not None and tool_call_parser not in TOOL_FORMATS:
        raise LmdError(f"--tool-call-parser {tool_call_parser} is unknown; use one of {', '.join(TOOL_FORMATS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise LmdError(f"--reasoning-parser {reasoning_parser} is unknown; use one of {', '.join(REASONING_PARSERS)}")
    if otlp_traces_endpoint is not None:
        from lmd.serve.tracing import traces_url

        traces_url(otlp_traces_endpoint)  # a bad URL fails before the model loads
    from lmd.engine_options import eager_overrides, open_chat_engine, speculative_overrides
    from lmd.turbomind.workspace import is_workspace

    if chat_template is not None and is_workspace(model):
        raise LmdError(
            f"{model} is a workspace: its chat template was fixed by `lmd deploy`; leave out "
            "--chat-template or redeploy with another MODEL_NAME"
        )
    overrides = dict(
        session_len=session_len,
        max_batch_size=max_batch_size,
        cache_max_entry_count=cache_max_entry_count,
        cache_block_seq_len=cache_block_seq_len,
        max_context_token_num=max_context_token_num,
        quant_policy=quant_policy,
        device=device,
        dtype=dtype,
        tp=tp,
        pp=pp,
        enable_prefix_caching=not no_enable_prefix_caching,
        offload_weights_gb=offload_weights_gb,
    )
    keys = [k for k in (api_keys or []) if k]
    overrides = {k: v for k, v in overrides.items() if v is not None} | eager_overrides(enforce_eager)
    overrides |= speculative_overrides(speculative_method, speculative_model, num_speculative_tokens,
                                       speculative_tree)
    with open_chat_engine(model, chat_template, overrides, engine_process=not disable_frontend_multiprocessing) as engine:
        _run(engine, model_name or _default_name(model), keys, host, port, log_level, tool_call_parser,
             otlp_traces_endpoint, reasoning_parser)


def _run(engine: Any, name: str, keys: list[str], host: str, port: int, log_level: str,
         tool_call_parser: str | None, otlp_traces_endpoint: str | None, reasoning_parser: str | None) -> None:
    import uvicorn
    from rich.console import Console
    from rich.table import Table

    from lmd.serve.app import create_app
    from lmd.turbomind.engine_core import EngineClient
    from lmd.turbomind.torchrun_env import torchrun_env

    app = create_app(engine, name, keys, tool_call_parser, otlp_traces_endpoint, reasoning_parser)
    tracer = app.state.server.tracer
    stats, cfg = engine.stats(), engine.workspace.engine
    table = Table(title="lmd serve", show_header=False)
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    for key, value in (
        ("url", f"http://{shown_host}:{port}/v1"),
        ("model", name),
        ("workspace", str(engine.workspace.root)),
        ("device", str(engine.runner.device)),
        ("engine", f"process {engine.pid}" if isinstance(engine, EngineClient) else "a thread of this process"),
        ("tensor parallel", _tp_mode(engine.workspace)),
        ("pipeline parallel", _pp_mode(engine.workspace)),
        ("max tokens per request", engine.max_len),
        ("max batch size", cfg.max_batch_size),
        ("KV blocks", f"{stats.blocks_total} x {cfg.cache_block_seq_len} tokens"),
        ("prefix caching", "on" if cfg.enable_prefix_caching else "off"),
        ("KV cache", "int8" if cfg.quant_policy == 4 else "compute dtype"),
        ("decode steps", _decode_mode(engine)),
        ("tool calls", _tool_mode(engine, tool_call_parser)),
        ("reasoning", f"{reasoning_parser} parser: reasoning_content" if reasoning_parser else "off (all content)"),
        ("API keys", f"{len(keys)} accepted" if keys else "none (open)"),
        ("tracing", f"OTLP spans to {tracer.url}" if tracer is not None else "off"),
    ):
        table.add_row(key, str(value))
    Console(stderr=True).print(table)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = _stoppable_server_class()(config, app.state.server.abort_all)
    stopped: list[str] = []
    if torchrun_env() is not None:  # rank 0 of a torchrun launch: it exits when another rank stops
        threading.Thread(target=_stop_when_a_rank_stops, args=(engine, server, stopped), daemon=True).start()
    try:
        server.run()
    finally:
        if tracer is not None:
            tracer.shutdown()  # the spans still queued go out
    if stopped:
        raise LmdError(stopped[0])


def _stop_when_a_rank_stops(engine: Any, server: Any, stopped: list[str]) -> None:
    """A failed model-parallel step leaves the ranks out of step for good: stop serving, with the engine's error."""
    while not server.should_exit:
        error = engine.last_error
        if error is not None and ("model-parallel" in str(error) or "engine process exited" in str(error)):
            text = str(error)
            start = text.find("model-parallel")
            stopped.append(text[start:].rstrip("')\"") if start >= 0 else text)
            server.should_exit = True
            return
        time.sleep(0.5)


def _tp_mode(ws: Any) -> str:
    tp, deployed = ws.engine.tp, ws.model.tensor_para_size
    how = "its rank files" if tp == deployed else f"weights {'merged' if tp == 1 else 'split'} at load"
    return f"{tp} rank{'s' if tp > 1 else ''} ({how}; deployed with tp {deployed})"


def _pp_mode(ws: Any) -> str:
    """Which rank holds what (pipeline_stage.layout_lines), one line per rank."""
    from lmd.turbomind.pipeline_stage import layout_lines

    cfg = ws.engine
    if cfg.pp == 1:
        return "off"
    return "\n".join([f"{cfg.pp} stages"] + layout_lines(ws.model.num_layer, cfg.tp, cfg.pp))


def _tool_mode(engine: Any, parser: str | None) -> str:
    template = engine.chat_template
    if not template.renders_tools(engine.tokenizer):
        return f"none (template {template.name!r} has no tool format)"
    parser = parser or template.tool_call_format(engine.tokenizer)
    return f"{parser} (template {template.name!r})" if parser else "no parser known: pass --tool-call-parser"


def _decode_mode(engine: Any) -> str:
    graphs = engine.runner.graphs
    if graphs is None or not graphs.capture:
        return "eager"
    return f"CUDA graphs, batch buckets {graphs.buckets[0]}..{graphs.buckets[-1]}"


def _stoppable_server_class() -> type:
    import uvicorn

    class StoppableServer(uvicorn.Server):
        """Ctrl+C / SIGTERM: in-flight generations end at once ("abort") so the graceful shutdown does not wait on
        them, and the signal is not re-raised afterwards, so the command returns (exit 0) and cleans up."""

        def __init__(self, config: uvicorn.Config, abort_all: Any) -> None:
            super().__init__(config)
            self._abort_all = abort_all

        def handle_exit(self, sig: int, frame: Any) -> None:
            with contextlib.suppress(RuntimeError):  # RuntimeError: no loop running yet, nothing in flight
                asyncio.get_running_loop().call_soon_threadsafe(self._abort_all)
            if self.should_exit:
                self.force_exit = True  # a second signal: stop waiting for connections
            self.should_exit = True

    return StoppableServer


def _default_name(model: str) -> str:
    path = Path(model).expanduser()
    name = path.resolve().name if path.exists() else model.rstrip("/").rsplit("/", 1)[-1]
    return name[: -len(".gguf")] if name.endswith(".gguf") else name
