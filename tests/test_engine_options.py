"""Command flags -> (sampling config, engine overrides) for chat, gradio and serve."""

from __future__ import annotations

from lmd.engine_options import split_flags

FLAGS = dict(temperature=0.0, top_p=0.8, top_k=40, repetition_penalty=1.0, max_new_tokens=8, seed=None,
             session_len=None, cache_max_entry_count=None, cache_block_seq_len=16, quant_policy=None,
             max_batch_size=None, device="cpu", dtype="auto", tp=None)


def test_unset_engine_flags_keep_config_ini_and_graphs_stay_on() -> None:
    gen, overrides = split_flags({**FLAGS, "enforce_eager": False})
    assert gen.max_new_tokens == 8 and gen.temperature == 0.0
    assert overrides == {"cache_block_seq_len": 16, "device": "cpu", "dtype": "auto"}


def test_enforce_eager_turns_decode_graphs_off() -> None:
    _, overrides = split_flags({**FLAGS, "enforce_eager": True})
    assert overrides["cuda_graph"] is False
