"""`lmd gradio MODEL`: a chat web page over the engine; every browser session has its own conversation."""

from __future__ import annotations

from typing import Annotated

import typer

from lmd.chat.options import (
    CacheBlockSeqLenOpt,
    CacheMaxEntryCountOpt,
    DeviceOpt,
    DtypeOpt,
    EnforceEagerOpt,
    MaxBatchSizeOpt,
    MaxNewTokensOpt,
    ModelArg,
    ModelNameOpt,
    QuantPolicyOpt,
    RepetitionPenaltyOpt,
    SeedOpt,
    SessionLenOpt,
    SystemOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    TpOpt,
)
from lmd.errors import LmdError


def gradio_command(
    model: ModelArg,
    server_name: Annotated[
        str, typer.Option("--server-name", help="Address to listen on; 127.0.0.1 keeps the page local to this machine.")
    ] = "0.0.0.0",
    server_port: Annotated[int, typer.Option("--server-port", help="Port to listen on.")] = 6006,
    share: Annotated[bool, typer.Option("--share", help="Also publish a temporary public *.gradio.live link.")] = False,
    model_name: ModelNameOpt = None,
    system: SystemOpt = None,
    temperature: TemperatureOpt = 0.8,
    top_p: TopPOpt = 0.8,
    top_k: TopKOpt = 40,
    repetition_penalty: RepetitionPenaltyOpt = 1.0,
    max_new_tokens: MaxNewTokensOpt = 512,
    seed: SeedOpt = None,
    session_len: SessionLenOpt = None,
    cache_max_entry_count: CacheMaxEntryCountOpt = None,
    cache_block_seq_len: CacheBlockSeqLenOpt = None,
    quant_policy: QuantPolicyOpt = None,
    max_batch_size: MaxBatchSizeOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    tp: TpOpt = None,
    enforce_eager: EnforceEagerOpt = False,
) -> None:
    """Serve a chat web page (gradio): streaming replies, Stop, Reset, sampling sliders.

    Every browser session has its own conversation; replies of several sessions are batched by the engine. The
    sampling flags set the sliders' starting values. Ctrl-C stops the server."""
    from lmd.chat.options import open_chat_engine, split_flags

    gen_config, overrides = split_flags(locals())  # first: locals() is exactly the flags here
    if not 0 < server_port < 65536:
        raise LmdError(f"--server-port {server_port} is not a port; use 1-65535")
    try:
        import gradio  # noqa: F401 - fail before the slow engine load
    except ImportError:
        raise LmdError("gradio is not installed; `pip install gradio` to use `lmd gradio`") from None
    from lmd.chat.gradio_app import build_app
    from lmd.chat.gradio_events import ChatEvents

    with open_chat_engine(model, model_name, overrides) as engine:
        app = build_app(ChatEvents(engine, gen_config, system), title=f"lmd chat — {model}")
        app.queue().launch(server_name=server_name, server_port=server_port, share=share, show_error=True)
