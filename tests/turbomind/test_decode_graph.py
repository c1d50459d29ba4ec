"""Decode steps on the static buffers of the CUDA-graph path give the plain path's tokens (run eagerly: no GPU here;
the capture itself is checked by benchmarks/gpu_engine_check.py on a GPU)."""

from __future__ import annotations

import pytest

from lmd.errors import LmdError
from lmd.turbomind.decode_graph import batch_buckets
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig


def _engine(ws, **overrides) -> Engine:
    options = dict(cache_block_seq_len=4, cache_max_entry_count=64, max_context_token_num=24, max_batch_size=8)
    options.update(overrides)
    return Engine(ws, start=False, **options)


def _generate(engine: Engine) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 3, 12)]
    # different lengths: the decode batch shrinks 6 -> 1, through buckets 8, 4, 2 and 1 with padding rows
    streams = [engine.generate(p, GenerationConfig(max_new_tokens=3 + 2 * i, temperature=0, ignore_eos=True))
               for i, p in enumerate(prompts)]
    while engine.step():
        pass
    return [s.result().token_ids for s in streams]


def test_buckets_step_by_eight_up_to_the_largest_batch() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(257)[-3:] == [248, 256, 257] and len(batch_buckets(256)) == 35


def test_cpu_engine_keeps_a_scratch_block_and_captures_nothing(tiny_llama_ws) -> None:
    engine = _engine(tiny_llama_ws[1])
    assert engine.runner.graphs is None
    assert engine.runner.num_blocks == engine.runner.cache.num_blocks - 1 == 64
    plain = _engine(tiny_llama_ws[1], cuda_graph=False)
    assert plain.runner.num_blocks == plain.runner.cache.num_blocks == 64
    with pytest.raises(LmdError, match="scratch block"):
        plain.runner.enable_decode_graphs(capture=False)


def test_static_decode_buffers_give_the_plain_paths_tokens(tiny_llama_ws, monkeypatch) -> None:
    expected = _generate(_engine(tiny_llama_ws[1], cuda_graph=False))
    engine = _engine(tiny_llama_ws[1])
    engine.runner.enable_decode_graphs(capture=False)
    graphs, sizes = engine.runner.graphs, []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda chunks, *rest: sizes.append(len(chunks)) or run(chunks, *rest))
    assert _generate(engine) == expected
    assert {graphs.bucket(n) for n in sizes} == {8, 4, 2, 1}
    assert any(n not in graphs.buckets for n in sizes)  # batches padded to their bucket
    stats = engine.stats()
    assert stats.blocks_used == 0 and stats.blocks_free == stats.blocks_total == 64


class _InProcessWorker:
    """A driver's `workers` that hands each step straight to another runner's `worker_step`, as a worker rank's
    loop does (tp > 1), recording whether the driver replayed its graph."""

    def __init__(self, runner) -> None:
        self.runner, self.graphed = runner, []

    def send(self, message) -> None:
        chunks, rows, graphed = message
        self.graphed.append(graphed)
        self.runner.worker_step(chunks, rows, graphed)

    def guard(self):
        import contextlib

        return contextlib.nullcontext()


def test_a_worker_replays_its_graph_exactly_when_the_driver_does(tiny_llama_ws) -> None:
    import torch

    expected = _generate(_engine(tiny_llama_ws[1], cuda_graph=False))
    engine, twin = _engine(tiny_llama_ws[1]), _engine(tiny_llama_ws[1])
    twin.runner.rank = 1  # a worker's graphs: the layers and the final norm, no logits
    for runner in (engine.runner, twin.runner):
        runner.enable_decode_graphs(capture=False)
        for pool in runner.cache.k + runner.cache.v:
            pool.zero_()  # the pools start uninitialized
    worker = _InProcessWorker(twin.runner)
    engine.runner.workers = worker
    try:
        assert _generate(engine) == expected
    finally:
        engine.runner.workers = None
    assert True in worker.graphed and False in worker.graphed  # decode steps replayed, prefills eager
    assert not twin.runner.graphs.logits and engine.runner.graphs.logits
    # the worker computed every step as the driver did, padding rows in the scratch block included
    for mine, theirs in ((engine.runner.cache.k, twin.runner.cache.k), (engine.runner.cache.v, twin.runner.cache.v)):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_a_worker_without_graphs_refuses_a_graph_step(tiny_llama_ws) -> None:
    runner = _engine(tiny_llama_ws[1]).runner
    with pytest.raises(LmdError, match="replays a decode graph, but this rank has none"):
        runner.worker_step([([5], 0, [0])], [0], graphed=True)


@pytest.mark.parametrize(("here", "other", "kept", "why"), [
    (True, True, True, None),
    (False, True, False, "the Triton attention runs on some ranks only"),
    (True, False, False, "the Triton attention runs on some ranks only"),
    (False, False, False, None),  # off everywhere (use_context_fmha=0): as quiet as one rank
])
def test_tp_ranks_capture_only_if_the_attention_runs_on_every_rank(tiny_llama_ws, monkeypatch, caplog, here, other,
                                                                    kept, why) -> None:
    from lmd.turbomind import model_runner

    runner = _engine(tiny_llama_ws[1]).runner
    runner.world, runner.tp = 2, 2  # as a tp = 2 rank sees it; the other rank votes through the fake collective
    theirs = iter((int(other), -int(other)))  # the other rank's votes: min, then -max
    monkeypatch.setattr(model_runner, "all_reduce_min", lambda v, device: min(v, next(theirs)))
    monkeypatch.setattr(runner, "_graphs_supported", lambda cfg: here)
    monkeypatch.setattr(runner, "enable_decode_graphs", lambda capture, agree: setattr(runner, "graphs", "captured"))
    runner._start_decode_graphs(None)
    assert (runner.graphs == "captured") is kept
    assert ("decode CUDA graphs off" in caplog.text) is (why is not None)
    if why:
        assert why in caplog.text


def test_a_failed_capture_anywhere_stops_every_rank_at_the_same_bucket(tiny_llama_ws, monkeypatch, caplog) -> None:
    from lmd.turbomind import model_runner
    from lmd.turbomind.decode_graph import CaptureFailed, DecodeGraphs

    runner = _engine(tiny_llama_ws[1]).runner
    graphs = DecodeGraphs(runner.model, runner.cache, runner.cache.num_blocks - 1, 8, 24, runner.device, capture=True)
    monkeypatch.setattr(graphs, "_warm_up", lambda b: b)
    failing = {4}  # this rank's capture of bucket 4 fails
    monkeypatch.setattr(graphs, "_capture", lambda b: (_ for _ in ()).throw(RuntimeError("no")) if b in failing
                        else ("graph", b))
    votes = []
    agree = lambda ok: votes.append(ok) or ok  # noqa: E731 (two ranks: the other succeeds)
    with pytest.raises(CaptureFailed, match="batch 4 failed here: RuntimeError: no"):
        graphs.capture_all(agree)
    assert votes == [True, False] and graphs.graphs == {}  # buckets 8, then 4: stopped there, nothing kept
    failing.clear()
    with pytest.raises(CaptureFailed, match="batch 8 failed on another rank"):
        graphs.capture_all(lambda ok: False)
    assert graphs.graphs == {}
    graphs.capture_all(lambda ok: True)
    assert sorted(graphs.graphs) == graphs.buckets
    # the runner turns it into eager steps, with a warning
    runner.world, runner.tp = 2, 2
    monkeypatch.setattr(model_runner, "all_reduce_min", lambda v, device: v)
    monkeypatch.setattr(runner, "_graphs_supported", lambda cfg: True)
    monkeypatch.setattr(runner, "enable_decode_graphs", lambda capture, agree: (_ for _ in ()).throw(
        CaptureFailed("capturing the decode graph of batch 8 failed on another rank")))
    runner._start_decode_graphs(None)
    assert runner.graphs is None
    assert "decode CUDA graphs off at tp=2: capturing the decode graph of batch 8 failed on another rank" in caplog.text


def test_one_rank_raises_a_capture_failure(tiny_llama_ws, monkeypatch) -> None:
    runner = _engine(tiny_llama_ws[1]).runner
    monkeypatch.setattr(runner, "_graphs_supported", lambda cfg: True)
    monkeypatch.setattr(runner, "enable_decode_graphs",
                        lambda capture, agree: (_ for _ in ()).throw(RuntimeError("broke")))
    with pytest.raises(RuntimeError, match="broke"):
        runner._start_decode_graphs(None)


def test_closing_releases_the_graphs_before_the_group_is_left(tiny_llama_ws) -> None:
    """NCCL's destroy waits for every graph that captured its collectives: close() resets them first."""

    class FakeGraph:
        resets = 0

        def reset(self) -> None:
            FakeGraph.resets += 1

    engine = _engine(tiny_llama_ws[1])
    engine.runner.enable_decode_graphs(capture=False)
    engine.runner.graphs.graphs = {1: (FakeGraph(), None), 2: (FakeGraph(), None)}
    engine.close()
    assert FakeGraph.resets == 2 and engine.runner.graphs is None and engine.runner.verify_graphs == {}
