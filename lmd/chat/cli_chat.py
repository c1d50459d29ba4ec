"""`lmd chat MODEL`: a multi-turn conversation in the terminal, replies streamed as they are generated."""

from __future__ import annotations

from lmd.engine_options import (
    CacheBlockSeqLenOpt,
    CacheMaxEntryCountOpt,
    DeviceOpt,
    DtypeOpt,
    EnforceEagerOpt,
    MaxNewTokensOpt,
    ModelArg,
    ModelNameOpt,
    NumSpeculativeTokensOpt,
    OffloadWeightsOpt,
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
)


def chat_command(
    model: ModelArg,
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
    """Chat with a model in the terminal or from piped lines; replies stream as they are generated.

    `exit`/`quit` leaves, `reset`/`new` starts a new conversation, Ctrl-C stops a reply. Each turn sends the whole
    conversation; the engine's prefix cache reuses the earlier turns' KV, so only the new text is computed."""
    from lmd.engine_options import open_chat_engine, split_flags

    gen_config, overrides = split_flags(locals())  # first: locals() is exactly the flags here
    from lmd.chat.session import ChatSession
    from lmd.chat.terminal import run_chat_loop, terminal_io

    with open_chat_engine(model, model_name, overrides) as engine:
        session = ChatSession(engine, gen_config, system)
        run_chat_loop(session, terminal_io(), title=f"lmd chat: {model}")
