"""The W4A16 autotuner's on-disk plan cache: round trips, stale entries, corrupt files, and the dispatcher's use of it."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from lmd.turbomind.kernels import w4a16  # noqa: E402
from lmd.turbomind.kernels import w4a16_plan_cache as plan_cache  # noqa: E402
from lmd.turbomind.kernels.w4a16_dequant import DequantConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemm import GemmConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemm_wt import WtGemmConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_gemv import GemvConfig  # noqa: E402
from lmd.turbomind.kernels.w4a16_mma_gemv import MmaGemvConfig  # noqa: E402

PLANS = [GemvConfig(256, 2, 64, 2, 1, 1), GemmConfig(16, 128, 64, 16, nibble_dots=True),
         WtGemmConfig(64, 16, 128, 8, 4, 3, "asm"), DequantConfig(8, 256, 8), MmaGemvConfig(16, 4, 2, True, False)]
KEY = w4a16.PlanKey(16, 11008, 4096, 128, torch.float16, "cuda:0")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LMD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LMD_W4A16_PLAN_CACHE", raising=False)
    return tmp_path


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: type(p).__name__)
def test_every_plan_kind_round_trips_through_the_file(plan) -> None:
    plan_cache.store("gpu|key", plan)
    entry = json.loads(plan_cache.cache_file().read_text())["gpu|key"]
    assert plan_cache.plan_from_json(entry, w4a16.PLAN_KINDS) == plan


def test_store_keeps_other_entries() -> None:
    plan_cache.store("a", PLANS[0])
    plan_cache.store("b", PLANS[2])
    assert set(plan_cache.load()) == {"a", "b"}


def test_stale_or_unknown_entries_are_ignored() -> None:
    entry = plan_cache.plan_to_json(PLANS[2])
    del entry["decode"]  # written by a version without this field
    assert plan_cache.plan_from_json(entry, w4a16.PLAN_KINDS) is None
    assert plan_cache.plan_from_json({"kind": "FlashConfig"}, w4a16.PLAN_KINDS) is None


def test_corrupt_file_reads_as_empty_and_is_rewritten() -> None:
    plan_cache.cache_file().write_text("{not json")
    assert plan_cache.load() == {}
    plan_cache.store("a", PLANS[1])
    assert list(plan_cache.load()) == ["a"]


def _resolve(can_tune: bool, tuned=PLANS[2]):
    calls = []

    def tune_fn(plans):
        assert plans == w4a16.candidates(KEY.bucket, KEY.n, KEY.k, KEY.group, torch.device("cpu"))
        calls.append(1)
        return tuned, [(tuned.name(), 0.01)]

    plan = w4a16.resolve_plan(KEY, torch.device("cpu"), "NVIDIA H200", can_tune, tune_fn)
    return plan, len(calls)


def test_tuned_plan_is_stored_and_reused_without_tuning() -> None:
    assert _resolve(True) == (PLANS[2], 1)
    assert _resolve(True, tuned=PLANS[0]) == (PLANS[2], 0)  # from disk: the tuner is not called
    assert _resolve(False) == (PLANS[2], 0)  # e.g. during a CUDA graph capture


def test_cache_is_per_gpu_and_can_be_turned_off(monkeypatch) -> None:
    _resolve(True)
    other = w4a16.resolve_plan(KEY, torch.device("cpu"), "NVIDIA A100", False, lambda plans: pytest.fail("tuned"))
    assert other == w4a16.default_plan(KEY.bucket, KEY.n, KEY.k, KEY.group, torch.device("cpu"))
    monkeypatch.setenv("LMD_W4A16_PLAN_CACHE", "0")
    assert _resolve(True, tuned=PLANS[0]) == (PLANS[0], 1)


def test_a_changed_candidate_list_is_tuned_again(monkeypatch) -> None:
    assert _resolve(True) == (PLANS[2], 1)
    original = w4a16.candidates
    monkeypatch.setattr(w4a16, "candidates", lambda *args: [*original(*args), PLANS[0]])  # a new candidate
    assert _resolve(True, tuned=PLANS[0]) == (PLANS[0], 1)
    assert _resolve(True, tuned=PLANS[1]) == (PLANS[0], 0)  # and that choice is cached under the new list
