"""Weight offload on CPU, the same code as on the GPU (host and device both CPU memory): the offloaded layers' linears
read device slots refilled from host copies every forward, and greedy tokens and logits equal the plain engine's,
with float and int4 weights; plans spread layers evenly; bad values are refused."""

from __future__ import annotations

import pytest
import torch

from lmd.errors import LmdError
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.weight_offload import plan_offload

OPTIONS = dict(cache_block_seq_len=4, cache_max_entry_count=64, max_batch_size=4)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (7, 19, 3)]


def _run(ws, **options) -> tuple[list[list[int]], list[list[float]], Engine]:
    engine = Engine(ws, start=False, **OPTIONS, **options)
    config = GenerationConfig(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    streams = [engine.generate(p, config, request_id=i) for i, p in enumerate(_prompts())]
    while engine.step():
        pass
    results = [s.result() for s in streams]
    return [r.token_ids for r in results], [r.logprobs for r in results], engine


def test_offloaded_engine_gives_the_plain_engines_tokens(tiny_llama_ws):
    ws = tiny_llama_ws[1]
    plain_tokens, plain_logprobs, plain = _run(ws)
    for gb in (1e-4, 100.0):  # one layer, every layer
        tokens, logprobs, engine = _run(ws, offload_weights_gb=gb)
        plan = engine.runner.offload_plan
        depth = engine.workspace.model.num_layer
        assert len(plan.layers) == (min(depth, 3) if gb < 1 else depth)  # one layer's worth + the two slots
        assert tokens == plain_tokens
        assert sum(logprobs, []) == pytest.approx(sum(plain_logprobs, []), abs=1e-6)
        layer = engine.runner.model.layers[plan.layers[0]]
        offload = engine.runner.model.offload
        assert layer.attention.w_qkv.weight.data_ptr() == offload.slots[0][0].data_ptr()  # reads the slot
        assert engine.stats().blocks_used == 0
        engine.close()
    plain.close()


def test_offloaded_int4_layers_travel_packed(tiny_llama_ws, tmp_path):
    from lmd.deploy.converter import deploy
    from tests.turbomind.awq_checkpoint import write_awq_checkpoint

    write_awq_checkpoint(tiny_llama_ws[0], tmp_path / "awq", group_size=64)
    ws = deploy("base", str(tmp_path / "awq"), str(tmp_path / "ws"), group_size=64, dtype="float16", progress=False)
    plain_tokens, _, plain = _run(ws, dtype="fp32")
    tokens, _, engine = _run(ws, dtype="fp32", offload_weights_gb=100.0)
    assert tokens == plain_tokens
    w13 = engine.runner.model.layers[0].mlp.w13
    assert type(w13).__name__ == "Int4Linear" and w13.qweight.dtype == torch.int32  # packed codes in the slot
    assert any(t.dtype == torch.int32 for t in engine.runner.model.offload.host[0])
    engine.close()
    plain.close()


def test_plans_spread_layers_and_bad_values_are_refused(tiny_llama_ws):
    assert plan_offload(0, 32, 100).layers == ()
    assert plan_offload(400 / 2**30, 32, 100).layers == (2, 8, 13, 18, 24, 29)  # 4 layers freed, 2 for the slots
    assert plan_offload(400 / 2**30, 32, 100).saved_bytes == 400
    assert plan_offload(1e9, 32, 100).layers == tuple(range(32))
    with pytest.raises(LmdError, match="offload_weights_gb=-1"):
        Engine(tiny_llama_ws[1], start=False, offload_weights_gb=-1)


def test_the_flag_reaches_the_engine_options():
    from lmd.bench.engine_setup import EngineOverrides
    from lmd.engine_options import split_flags

    flags = dict(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_new_tokens=8, seed=None,
                 offload_weights_gb=2.5)
    assert split_flags(flags)[1]["offload_weights_gb"] == 2.5
    assert EngineOverrides(offload_weights_gb=2.5).as_kwargs()["offload_weights_gb"] == 2.5
