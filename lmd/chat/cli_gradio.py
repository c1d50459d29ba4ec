"""`lmd gradio MODEL`: a chat web page over the engine; every browser session has its own conversation."""

from __future__ import annotations

from typing import Annotated

import typer

from lmd.engine_options import (
    CacheBlockSeqLenOpt,
    CacheMaxEntryCountOpt,
    DeviceOpt,
    DtypeOpt,
    EnforceEagerOpt,
    HostOpt,
    MaxBatchSizeOpt,
    MaxNewTokensOpt,
    ModelArg,
    ModelNameOpt,
    NumSpeculativeTokensOpt,
    OffloadWeightsOpt,
    PortOpt,
    PpOpt,
    QuantPolicyOpt,
    RepetitionPenaltyOpt,
    SeedOpt,
    SessionLenOpt,
    SpeculativeMethodOpt,
    SpeculativeModelOpt,
    SpeculativeTreeOpt,
    SystemOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    TpOpt,
    check_port,
)
from lmd.errors import LmdError


def gradio_command(
    model: ModelArg,
    host: HostOpt = "0.0.0.0",
    port: PortOpt = 6006,
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
    pp: PpOpt = None,
    enforce_eager: EnforceEagerOpt = False,
    offload_weights_gb: OffloadWeightsOpt = None,
    speculative_method: SpeculativeMethodOpt = None,
    speculative_model: SpeculativeModelOpt = None,
    num_speculative_tokens: NumSpeculativeTokensOpt = None,
    speculative_tree: SpeculativeTreeOpt = None,
) -> None:
    """Serve a chat web page (gradio): streaming replies, Stop, Reset, sampling sliders.

    Every browser session has its own conversation; replies of several sessions are batched by the engine. The
    sampling flags set the sliders' starting values. Ctrl-C stops the server."""
    from lmd.engine_options import open_chat_engine, split_flags

    gen_config, overrides = split_flags(locals())  # first: locals() is exactly the flags here
    check_port(port)
    try:
        import gradio  # noqa: F401 - fail before the slow engine load
    except ImportError:
        raise LmdError("gradio is not installed; `pip install gradio` to use `lmd gradio`") from None
    from lmd.chat.gradio_app import build_app
    from lmd.chat.gradio_events import ChatEvents

    with open_chat_engine(model, model_name, overrides) as engine:
        app = build_app(ChatEvents(engine, gen_config, system), title=f"lmd chat — {model}")
        app.queue().launch(server_name=host, server_port=port, share=share, show_error=True)
