"""The streaming writer produces files safetensors reads back bit-exactly, for every dtype deploy writes."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lmd.deploy.safetensors_stream import SafetensorsStreamWriter


def test_stream_writer_round_trip(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "a.fp16": torch.randn(3, 5).half(),
        "b.bf16": torch.randn(7).bfloat16(),
        "c.fp32": torch.randn(2, 3, 4),
        "d.int32": torch.randint(-2**31, 2**31 - 1, (4, 6), dtype=torch.int32),
        "e.view": torch.randn(8, 8)[:, 2:5],  # non-contiguous slice, as TP splits produce
    }
    path = tmp_path / "x.safetensors"
    writer = SafetensorsStreamWriter(path, {"rank": "0"})
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()
    assert not (tmp_path / "x.safetensors.part").exists()
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor), name
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"rank": "0"}


def test_abort_leaves_nothing(tmp_path):
    writer = SafetensorsStreamWriter(tmp_path / "y.safetensors")
    writer.add("a", torch.zeros(3))
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_header_larger_than_the_reserved_region_falls_back_to_a_copy(tmp_path, monkeypatch):
    from lmd.deploy import safetensors_stream

    monkeypatch.setattr(safetensors_stream, "_RESERVED", 64)
    tensors = {f"layers.{i}.weight": torch.full((i + 1,), float(i)) for i in range(20)}
    writer = SafetensorsStreamWriter(tmp_path / "z.safetensors")
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    path = writer.close()
    assert list(tmp_path.iterdir()) == [path]
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())


def test_file_holds_only_the_header_region_and_the_data(tmp_path):
    from lmd.deploy import safetensors_stream

    writer = SafetensorsStreamWriter(tmp_path / "w.safetensors")
    writer.add("a", torch.zeros(1000))
    path = writer.close()
    assert path.stat().st_size == 8 + safetensors_stream._RESERVED + 4000
