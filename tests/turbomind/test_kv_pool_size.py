"""The KV pool's size on a GPU: a fraction of free device memory, within a per-process memory cap when one is set
(the driver's free figure ignores the cap). The CUDA queries are replaced, so this runs on CPU."""

from __future__ import annotations

import torch

from lmd.turbomind import kv_cache

GIB = 2**30


def _fake_cuda(monkeypatch, free: int, total: int, fraction: float, allocated: int) -> None:
    def index_only(value):  # torch's fraction query refuses a device without an index ("cuda")
        def query(device):
            assert isinstance(device, int), f"got {device!r}, not a device index"
            return value
        return query

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", index_only((free, total)))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", index_only(fraction), raising=False)
    monkeypatch.setattr(torch.cuda, "memory_allocated", index_only(allocated))


def test_pool_is_a_fraction_of_free_memory_without_a_cap(monkeypatch):
    _fake_cuda(monkeypatch, free=100 * GIB, total=140 * GIB, fraction=1.0, allocated=30 * GIB)
    assert kv_cache.plan_num_blocks(0.5, GIB, torch.device("cuda"), max_useful_blocks=10**9) == 50


def test_pool_fits_under_the_per_process_cap(monkeypatch):
    # a 16 GiB cap with 10 GiB of weights allocated: half of the 6 GiB left, not half of the driver's 100 GiB
    _fake_cuda(monkeypatch, free=100 * GIB, total=128 * GIB, fraction=16 / 128, allocated=10 * GIB)
    assert kv_cache.plan_num_blocks(0.5, GIB, torch.device("cuda"), max_useful_blocks=10**9) == 3
