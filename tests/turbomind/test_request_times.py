"""A request's final delta says when it was queued, first scheduled, gave its first token and finished."""

from __future__ import annotations

from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig

OPTIONS = dict(cache_block_seq_len=4, cache_max_entry_count=64, max_batch_size=2)


def test_times_are_in_order_and_unscheduled_requests_have_none(tiny_llama_ws):
    engine = Engine(tiny_llama_ws[1], start=False, **OPTIONS)
    config = GenerationConfig(max_new_tokens=3, temperature=0, ignore_eos=True)
    first, second = (engine.generate([5, 6, 7], config, request_id=i) for i in range(2))
    third = engine.generate([8, 9], config, request_id=2)  # max_batch_size 2: waits
    samples = engine.generate_samples([1, 2, 3], GenerationConfig(n=2, max_new_tokens=2, temperature=1.0, seed=1,
                                                                  ignore_eos=True), request_id="s")
    engine.step()
    engine.abort(2)  # before any step computed it
    while engine.step():
        pass
    for stream in (first, second, *samples):
        times = stream.result().times
        assert times is not None and times.scheduled is not None and times.first_token is not None
        assert times.queued <= times.scheduled <= times.first_token <= times.finished
    aborted = third.result()
    assert aborted.finish_reason == "abort" and aborted.times.scheduled is None and aborted.times.first_token is None
    engine.close()
