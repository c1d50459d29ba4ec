"""kv-qparams: formulas (asym/sym), TP split, file format and metadata, and every error path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lmd.errors import LmdError
from lmd.lite.kv_qparams import KVQParamsConfig, compute_qparams, export_kv_qparams

LAYERS, KV_HEADS, HEAD_DIM = 3, 4, 8


def _stats(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    hi = torch.rand(LAYERS, KV_HEADS, HEAD_DIM, generator=gen) * 5
    lo = -torch.rand(LAYERS, KV_HEADS, HEAD_DIM, generator=gen) * 3 + 1  # some heads entirely positive-shifted
    absmax = torch.maximum(hi.abs(), lo.abs())
    return {stat: {f"model.layers.{i}": t[i] for i in range(LAYERS)}
            for stat, t in (("max", hi), ("min", lo), ("absmax", absmax))}


def write_work_dir(path: Path, layers: int = LAYERS, num_heads: int | None = 8) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, seed in (("key_stats.pth", 0), ("value_stats.pth", 1)):
        stats = _stats(seed)
        torch.save({stat: {k: v for k, v in d.items() if int(k.rsplit(".", 1)[1]) < layers}
                    for stat, d in stats.items()}, path / name)
    if num_heads is not None:
        (path / "calib.json").write_text(json.dumps({"num_heads": num_heads, "dataset": "c4"}))
    return path


def write_workspace(root: Path, tp: int = 1, layers: int = LAYERS, kv_heads: int = KV_HEADS,
                    heads: int = 8, head_dim: int = HEAD_DIM) -> Path:
    weights = root / "triton_models" / "weights"
    weights.mkdir(parents=True)
    (weights / "config.ini").write_text(
        f"[llama]\ntensor_para_size = {tp}\nhead_num = {heads}\nkv_head_num = {kv_heads}\n"
        f"size_per_head = {head_dim}\nnum_layer = {layers}\n")
    return weights


def test_asymmetric_formula_per_layer_and_head():
    stats = _stats(0)
    scale, zero = compute_qparams(stats, symmetric=False)
    assert scale.shape == zero.shape == (LAYERS, KV_HEADS) and scale.dtype == torch.float32
    for i in range(LAYERS):
        for h in range(KV_HEADS):
            hi = stats["max"][f"model.layers.{i}"][h].max()
            lo = stats["min"][f"model.layers.{i}"][h].min()
            assert zero[i, h] == pytest.approx(float((hi + lo) / 2), rel=1e-6)
            assert scale[i, h] == pytest.approx(float((hi - lo) / 255), rel=1e-6)


def test_symmetric_formula():
    stats = _stats(1)
    scale, zero = compute_qparams(stats, symmetric=True)
    assert torch.equal(zero, torch.zeros(LAYERS, KV_HEADS))
    expected = torch.stack([stats["absmax"][f"model.layers.{i}"].amax(-1) for i in range(LAYERS)]) / 127
    torch.testing.assert_close(scale, expected)


@pytest.mark.parametrize("symmetric", [False, True])
def test_params_round_trip_calibrated_range_within_half_step(symmetric):
    stats = _stats(2)
    scale, zero = compute_qparams(stats, symmetric=symmetric)
    hi = torch.stack([stats["max"][f"model.layers.{i}"] for i in range(LAYERS)])  # [L, H, D]
    lo = torch.stack([stats["min"][f"model.layers.{i}"] for i in range(LAYERS)])
    for t in torch.linspace(0, 1, 11):
        x = lo + (hi - lo) * t
        s, z = scale[..., None], zero[..., None]
        q = torch.clamp(torch.round((x - z) / s), -128, 127)
        assert torch.all((q * s + z - x).abs() <= s / 2 + 1e-5)


@pytest.mark.parametrize("symmetric", [False, True])
def test_per_channel_keeps_the_head_dim_and_is_never_coarser(symmetric):
    stats = _stats(3)
    scale, zero = compute_qparams(stats, symmetric=symmetric, per_channel=True)
    assert scale.shape == zero.shape == (LAYERS, KV_HEADS, HEAD_DIM)
    head_scale, _ = compute_qparams(stats, symmetric=symmetric)
    assert torch.all(scale <= head_scale[..., None] + 1e-7)
    if symmetric:  # absmax per head is the max of the channels' absmax
        assert torch.equal(scale.amax(-1), head_scale)
    else:
        hi, lo = stats["max"]["model.layers.1"], stats["min"]["model.layers.1"]
        torch.testing.assert_close(scale[1], (hi - lo).float() / 255)
        torch.testing.assert_close(zero[1], (hi + lo).float() / 2)


def test_constant_channel_gets_positive_scale():
    stats = _stats(0)
    for stat in ("max", "min", "absmax"):
        stats[stat]["model.layers.0"] = torch.full((KV_HEADS, HEAD_DIM), 0.0)
    scale, _ = compute_qparams(stats, symmetric=False)
    assert torch.all(scale > 0)


def test_export_tp1_file_format_and_metadata(tmp_path):
    work = write_work_dir(tmp_path / "work")
    weights = write_workspace(tmp_path / "ws")
    result = export_kv_qparams(KVQParamsConfig(str(work), str(weights), granularity="head"))
    path = weights / "kv_qparams.rank0.safetensors"
    assert result.files == (str(path.resolve()),)
    tensors = load_file(path)
    assert set(tensors) == {f"layers.{i}.{kv}_{p}" for i in range(LAYERS) for kv in "kv" for p in ("scale", "zero")}
    assert all(t.dtype == torch.float32 and t.shape == (KV_HEADS,) for t in tensors.values())
    k_scale, k_zero = compute_qparams(torch.load(work / "key_stats.pth"), symmetric=False)
    v_scale, v_zero = compute_qparams(torch.load(work / "value_stats.pth"), symmetric=False)
    for i in range(LAYERS):
        assert torch.equal(tensors[f"layers.{i}.k_scale"], k_scale[i])
        assert torch.equal(tensors[f"layers.{i}.k_zero"], k_zero[i])
        assert torch.equal(tensors[f"layers.{i}.v_scale"], v_scale[i])
        assert torch.equal(tensors[f"layers.{i}.v_zero"], v_zero[i])
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert {k: meta[k] for k in ("kv_bits", "symmetric", "num_tp")} == {"kv_bits": "8", "symmetric": "0",
                                                                         "num_tp": "1"}
    assert result.num_layers == LAYERS and result.kv_heads == KV_HEADS


def test_export_tp2_splits_heads_and_accepts_workspace_root(tmp_path):
    work = write_work_dir(tmp_path / "work")
    weights = write_workspace(tmp_path / "ws", tp=2)
    export_kv_qparams(KVQParamsConfig(str(work), str(tmp_path / "ws"), symmetric=True, num_tp=2, granularity="head"))
    ranks = [load_file(weights / f"kv_qparams.rank{r}.safetensors") for r in range(2)]
    k_scale, _ = compute_qparams(torch.load(work / "key_stats.pth"), symmetric=True)
    for i in range(LAYERS):
        assert ranks[0][f"layers.{i}.k_scale"].shape == (KV_HEADS // 2,)
        assert torch.equal(torch.cat([r[f"layers.{i}.k_scale"] for r in ranks]), k_scale[i])
        assert torch.equal(ranks[1][f"layers.{i}.v_zero"], torch.zeros(KV_HEADS // 2))
    with safe_open(str(weights / "kv_qparams.rank1.safetensors"), "pt") as f:
        assert f.metadata()["symmetric"] == "1" and f.metadata()["num_tp"] == "2"
        assert f.metadata()["granularity"] == "head"


def test_export_per_channel_tp2_splits_heads_keeping_channels(tmp_path):
    work = write_work_dir(tmp_path / "work")
    weights = write_workspace(tmp_path / "ws", tp=2)
    result = export_kv_qparams(KVQParamsConfig(str(work), str(weights), num_tp=2, granularity="channel"))
    ranks = [load_file(weights / f"kv_qparams.rank{r}.safetensors") for r in range(2)]
    k_scale, _ = compute_qparams(torch.load(work / "key_stats.pth"), symmetric=False, per_channel=True)
    for i in range(LAYERS):
        assert ranks[1][f"layers.{i}.k_zero"].shape == (KV_HEADS // 2, HEAD_DIM)
        assert torch.equal(torch.cat([r[f"layers.{i}.k_scale"] for r in ranks]), k_scale[i])
    with safe_open(str(weights / "kv_qparams.rank0.safetensors"), "pt") as f:
        assert f.metadata()["granularity"] == "channel"
    assert result.per_channel


def test_existing_params_need_force(tmp_path):
    work = write_work_dir(tmp_path / "work")
    weights = write_workspace(tmp_path / "ws")
    export_kv_qparams(KVQParamsConfig(str(work), str(weights), granularity="channel"))
    with pytest.raises(LmdError, match="--force"):
        export_kv_qparams(KVQParamsConfig(str(work), str(weights), symmetric=True))
    export_kv_qparams(KVQParamsConfig(str(work), str(weights), symmetric=True, granularity="channel", force=True))
    k_zero = load_file(weights / "kv_qparams.rank0.safetensors")["layers.0.k_zero"]
    assert torch.equal(k_zero, torch.zeros(KV_HEADS, HEAD_DIM))
    assert sorted(p.name for p in weights.iterdir()) == ["config.ini", "kv_qparams.rank0.safetensors"]


@pytest.mark.parametrize("workspace,work,match", [
    ({"tp": 2}, {}, r"--num-tp 1 does not match .*tensor_para_size=2; use --num-tp 2"),
    ({"layers": 4}, {}, r"num_layer=3 but .*num_layer=4"),
    ({"kv_heads": 2, "heads": 4}, {}, r"kv_head_num=4 but .*kv_head_num=2"),
    ({"head_dim": 16}, {}, r"size_per_head=8 but .*size_per_head=16"),
    ({"heads": 16}, {}, r"head_num=8 but .*head_num=16"),
])
def test_shape_mismatches_name_both_sides(tmp_path, workspace, work, match):
    work_dir = write_work_dir(tmp_path / "work", **work)
    weights = write_workspace(tmp_path / "ws", **workspace)
    with pytest.raises(LmdError, match=match):
        export_kv_qparams(KVQParamsConfig(str(work_dir), str(weights)))
    assert not list(weights.glob("kv_qparams*"))


def test_bad_bits_missing_stats_and_missing_config(tmp_path):
    with pytest.raises(LmdError, match="--kv-bits 4 is not supported"):
        KVQParamsConfig("w", "t", kv_bits=4)
    with pytest.raises(LmdError, match="--granularity 'token' is not valid; use channel or head"):
        KVQParamsConfig("w", "t", granularity="token")
    weights = write_workspace(tmp_path / "ws")
    work = tmp_path / "work"
    work.mkdir()
    torch.save(_stats(0), work / "key_stats.pth")
    with pytest.raises(LmdError, match="value_stats.pth is missing; run `lmd calibrate"):
        export_kv_qparams(KVQParamsConfig(str(work), str(weights)))
    with pytest.raises(LmdError, match="does not exist"):
        export_kv_qparams(KVQParamsConfig(str(tmp_path / "nope"), str(weights)))
    (work / "value_stats.pth").write_bytes(b"not a pickle")
    with pytest.raises(LmdError, match="not a readable stats file"):
        export_kv_qparams(KVQParamsConfig(str(work), str(weights)))
    with pytest.raises(LmdError, match="holds no config.ini"):
        export_kv_qparams(KVQParamsConfig(str(work), str(tmp_path)))
