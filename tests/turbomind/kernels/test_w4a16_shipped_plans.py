"""The W4A16 plans shipped per GPU: every entry names a current candidate, and the dispatcher takes a shipped plan
instead of tuning, after the plans tuned on this machine and only where GPU and Triton version match."""

from __future__ import annotations

import json

import pytest
import torch

triton = pytest.importorskip("triton")

from lmd.turbomind.kernels import w4a16  # noqa: E402
from lmd.turbomind.kernels import w4a16_plan_cache as plan_cache  # noqa: E402
from lmd.turbomind.kernels import w4a16_shipped_plans as shipped  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemv import GemvConfig  # noqa: E402

SMS = {"NVIDIA H200": 132, "NVIDIA H100 80GB HBM3": 132}  # the candidate list depends on the SM count (split-K sizes)
GPU = "NVIDIA H200"
KEY = w4a16.PlanKey(64, 12288, 4096, 128, torch.float16, "cuda:0")
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def h200(tmp_path, monkeypatch):
    monkeypatch.setenv("LMD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LMD_W4A16_PLAN_CACHE", raising=False)
    monkeypatch.delenv("LMD_W4A16_TIMER", raising=False)  # the default, cold: the timer the shipped tables were tuned by
    w4a16.tune_timer.cache_clear()
    monkeypatch.setattr(w4a16, "_sms", lambda device: SMS[GPU])
    monkeypatch.setattr(triton, "__version__", "3.6.0")


def tables() -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(shipped.TABLES.glob("*.json"))]


def test_every_shipped_plan_is_a_current_candidate(monkeypatch) -> None:
    assert tables(), f"no tables under {shipped.TABLES}"
    for table in tables():
        assert shipped.table_file(table["gpu"], table.get("timer", "cold")).exists()
        monkeypatch.setattr(w4a16, "_sms", lambda device, gpu=table["gpu"]: SMS[gpu])
        # the opt-in families its tuning offered are offered here too
        offered = set(table.get("opt_in", []))
        mode = "all" if offered == set(shipped.OPT_IN_FAMILIES) else "default" if offered else "none"
        monkeypatch.setattr(w4a16.w4a16_mma_gemv, "cuda_kernels", lambda device, m=mode: m)
        monkeypatch.setattr(w4a16.w4a16_wgmma, "runs_on", lambda device, o=offered: "wgmma" in o)  # an sm_90 table
        for key, name in table["plans"].items():
            bucket, n, k, group = (int(part[1:]) for part in key.split()[:4])
            names = [plan.name() for plan in w4a16.candidates(bucket, n, k, group, CUDA)]
            assert name in names, f"{table['gpu']} {key}: {name} is no longer a candidate (re-run w4a16_tune.py)"


def _resolve(tuned=GemvConfig(128, 8, 2, 4, 1, 64)):
    calls = []

    def tune_fn(plans):
        calls.append(1)
        return tuned, [(tuned.name(), 0.01)]

    return w4a16.resolve_plan(KEY, CUDA, GPU, True, tune_fn), len(calls)


def test_shipped_plan_is_used_without_tuning() -> None:
    plan, tunings = _resolve()
    assert tunings == 0
    assert plan.name() == tables()[0]["plans"]["m64 n12288 k4096 g128 float16"]


def test_plan_tuned_on_this_machine_comes_first() -> None:
    plans = w4a16.candidates(KEY.bucket, KEY.n, KEY.k, KEY.group, CUDA)
    tuned_here = plans[-1]
    assert tuned_here.name() != tables()[0]["plans"]["m64 n12288 k4096 g128 float16"]
    fingerprint = plan_cache.candidates_fingerprint([p.name() for p in plans])
    plan_cache.store(plan_cache.cache_key(GPU, KEY.bucket, KEY.n, KEY.k, KEY.group, "float16", fingerprint), tuned_here)
    assert _resolve() == (tuned_here, 0)


def test_other_triton_or_gpu_or_cache_off_tunes(monkeypatch) -> None:
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    assert _resolve()[1] == 1
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    other = w4a16.resolve_plan(KEY, CUDA, "NVIDIA A100-SXM4-80GB", False, lambda plans: pytest.fail("tuned"))
    assert other == w4a16.default_plan(KEY.bucket, KEY.n, KEY.k, KEY.group, CUDA)
    monkeypatch.setenv("LMD_W4A16_PLAN_CACHE", "0")
    assert _resolve()[1] == 1


def test_a_plan_no_longer_among_the_candidates_is_not_used(monkeypatch) -> None:
    name = tables()[0]["plans"]["m64 n12288 k4096 g128 float16"]
    original = w4a16.candidates
    monkeypatch.setattr(w4a16, "candidates", lambda *args: [p for p in original(*args) if p.name() != name])
    assert _resolve()[1] == 1


def test_table_round_trip(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(shipped, "TABLES", tmp_path)
    shipped._table.cache_clear()
    plan = GemvConfig(512, 2, 51, 4, 1, 1)
    text = shipped.table_json("Some GPU 9", "3.6.2", "test", {shipped.entry_key(1, 8, 16, 128, "float16"): plan.name()})
    shipped.table_file("Some GPU 9").write_text(text)
    assert shipped.table_file("Some GPU 9").name == "some_gpu_9.json"
    assert shipped.lookup("Some GPU 9", "cold", 1, 8, 16, 128, "float16", [GemvConfig(), plan]) is plan
    assert shipped.lookup("Some GPU 9", "cold", 2, 8, 16, 128, "float16", [GemvConfig(), plan]) is None
    shipped._table.cache_clear()


def test_a_table_tuned_without_an_opt_in_family_does_not_judge_it(tmp_path, monkeypatch) -> None:
    from lmd.turbomind.kernels.w4a16_mma_gemv import MmaGemvConfig

    monkeypatch.setattr(shipped, "TABLES", tmp_path)
    shipped._table.cache_clear()
    plan, mma = GemvConfig(512, 2, 51, 4, 1, 1), MmaGemvConfig(8, 4, 2, True)
    key = shipped.entry_key(1, 64, 256, 128, "float16")
    shipped.table_file("Some GPU 9").write_text(shipped.table_json("Some GPU 9", "3.6.2", "t", {key: plan.name()}))
    assert shipped.lookup("Some GPU 9", "cold", 1, 64, 256, 128, "float16", [plan, mma]) is plan
    assert shipped.unjudged("Some GPU 9", "cold", [plan, mma]) == [mma]
    shipped._table.cache_clear()
    shipped.table_file("Some GPU 9").write_text(
        shipped.table_json("Some GPU 9", "3.6.2", "t", {key: mma.name()}, opt_in=["mma-gemv"]))
    assert shipped.lookup("Some GPU 9", "cold", 1, 64, 256, 128, "float16", [plan, mma]) is mma
    assert shipped.unjudged("Some GPU 9", "cold", [plan, mma]) == []
    shipped._table.cache_clear()


def test_opt_in_candidates_are_tuned_against_the_tables_winner_alone(tmp_path, monkeypatch) -> None:
    from lmd.turbomind.kernels import w4a16_mma_gemv

    key = w4a16.PlanKey(16, 12288, 4096, 128, torch.float16, "cuda:0")
    monkeypatch.setattr(w4a16_mma_gemv, "cuda_kernels", lambda device: "all")
    winner = tables()[0]["plans"]["m16 n12288 k4096 g128 float16"]
    timed = []

    def tune(plans):
        timed.append([p.name() for p in plans])
        return plans[-1], []

    chosen = w4a16.resolve_plan(key, CUDA, GPU, True, tune)
    assert timed[0][0] == winner and len(timed[0]) > 10
    assert all(name.startswith(("mma-gemv", "mma-gemm")) for name in timed[0][1:])
    assert chosen.name().startswith("mma-")
    assert w4a16.resolve_plan(key, CUDA, GPU, True, tune) == chosen and len(timed) == 1  # cached on disk
    monkeypatch.setenv("LMD_CACHE_DIR", str(tmp_path / "fresh"))
    assert w4a16.resolve_plan(key, CUDA, GPU, False, tune).name() == winner  # cannot tune: the table's plan


def test_each_timer_reads_its_own_table(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(shipped, "TABLES", tmp_path)
    shipped._table.cache_clear()
    cold_plan, graph_plan = GemvConfig(512, 2, 51, 4, 1, 1), GemvConfig()
    key = shipped.entry_key(1, 8, 16, 128, "float16")
    for timer, plan in (("cold", cold_plan), ("graph", graph_plan)):
        shipped.table_file("Some GPU 9", timer).write_text(
            shipped.table_json("Some GPU 9", "3.6.2", "t", {key: plan.name()}, timer=timer))
    assert shipped.table_file("Some GPU 9", "graph").name == "some_gpu_9.graph.json"
    candidates = [graph_plan, cold_plan]
    assert shipped.lookup("Some GPU 9", "cold", 1, 8, 16, 128, "float16", candidates) is cold_plan
    assert shipped.lookup("Some GPU 9", "graph", 1, 8, 16, 128, "float16", candidates) is graph_plan
    # a table whose recorded timer is not the one it is read for is not used
    shipped.table_file("Some GPU 9", "graph").write_text(
        shipped.table_json("Some GPU 9", "3.6.2", "t", {key: graph_plan.name()}, timer="cold"))
    shipped._table.cache_clear()
    assert shipped.lookup("Some GPU 9", "graph", 1, 8, 16, 128, "float16", candidates) is None
    shipped._table.cache_clear()


def test_the_graph_timer_neither_reads_the_cold_table_nor_its_cache(monkeypatch) -> None:
    monkeypatch.setattr(w4a16, "tune_timer", lambda: "graph")
    tuned = GemvConfig(64, 8, 2, 4, 1, 64)
    assert _resolve(tuned) == (tuned, 1)  # no graph table for the GPU: tunes
    assert _resolve(tuned) == (tuned, 0)  # cached under the graph timer's key
    monkeypatch.setattr(w4a16, "tune_timer", lambda: "cold")
    plan, tunings = _resolve(tuned)
    assert tunings == 0 and plan.name() == tables()[0]["plans"]["m64 n12288 k4096 g128 float16"] != tuned.name()
