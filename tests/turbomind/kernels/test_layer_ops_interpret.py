"""The Triton layer ops (residual add + RMSNorm, SiLU * up, RoPE + KV write) under Triton's CPU interpreter against
their PyTorch references, and a tiny model's logits with them against the reference path.

All cases run in one fresh process (this file run as a script, TRITON_INTERPRET=1 set before Triton decorates the
kernels); the script prints one JSON object, case name -> error (or the exception text).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.turbomind.kernels.interpreter import run_jobs

ULP = {"fp32": 1e-6, "fp16": 2e-3}  # error relative to the output's largest magnitude: one fp16 rounding step


def _dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16}[name]


def _rel(out, ref) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def norm_case(dtype: str, hidden: int, with_delta: bool) -> dict[str, float]:
    import torch

    from lmd.turbomind.kernels.rms_norm import add_rms_norm_triton
    from lmd.turbomind.layers import add_rms_norm_reference

    g = torch.Generator().manual_seed(hidden)
    wide = torch.randn(5, hidden + 56, generator=g).to(_dtype(dtype))
    h = wide[:, 3 : 3 + hidden]  # strided rows, as a slice of a wider tensor
    delta = torch.randn(5, hidden, generator=g).to(_dtype(dtype)) if with_delta else None
    weight = (torch.rand(hidden, generator=g) + 0.5).to(_dtype(dtype))
    total, normed = add_rms_norm_triton(h, delta, weight, 1e-5)
    ref_total, ref_normed = add_rms_norm_reference(h, delta, weight, 1e-5)
    assert normed.shape == (5, hidden) and normed.dtype == h.dtype
    return {"sum": (total.float() - ref_total.float()).abs().max().item(), "normed": _rel(normed, ref_normed)}


def silu_case(dtype: str, inter: int) -> float:
    import torch

    from lmd.turbomind.kernels.silu_mul import silu_mul_triton
    from lmd.turbomind.layers import silu_mul_reference

    gu = (torch.randn(4, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 3).to(_dtype(dtype))
    return _rel(silu_mul_triton(gu), silu_mul_reference(gu))


def rotary_case(dtype: str, head_dim: int, rot: int, to_cache: bool, hq: int = 4, hkv: int = 2) -> float:
    """q, k, v of the kernel against rotary_qkv_reference; with the cache: slots shuffled, the pool poisoned
    with NaN, and every slot the batch does not own still NaN afterwards."""
    import torch

    from lmd.turbomind.kernels.rotary import rotary_qkv_triton
    from lmd.turbomind.kv_cache import KVCache
    from lmd.turbomind.rope import rotary_qkv_reference

    dt, t = _dtype(dtype), 6
    g = torch.Generator().manual_seed(head_dim + rot)
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=g).to(dt)
    angles = torch.rand(t, rot // 2, generator=g) * 6
    cos, sin = torch.cat((angles, angles), -1).cos().to(dt), torch.cat((angles, angles), -1).sin().to(dt)
    q_ref, k_ref, v_ref = rotary_qkv_reference(qkv, cos, sin, hq, hkv, head_dim)
    if not to_cache:
        q, k, v = rotary_qkv_triton(qkv, cos, sin, hq, hkv, head_dim)
        return max(_rel(q, q_ref), _rel(k, k_ref), _rel(v, v_ref))
    cache = KVCache(1, 4, 4, hkv, head_dim, dt, torch.device("cpu"))
    cache.k[0].fill_(float("nan"))
    cache.v[0].fill_(float("nan"))
    slots = torch.randperm(16, generator=g)[:t]
    q, _, _ = rotary_qkv_triton(qkv, cos, sin, hq, hkv, head_dim, *cache.float_slots(0), slots)
    k_flat, v_flat = cache.float_slots(0)
    others = torch.ones(16, dtype=torch.bool)
    others[slots] = False
    assert bool(k_flat[others].isnan().all()) and bool(v_flat[others].isnan().all()), "wrote outside its slots"
    return max(_rel(q, q_ref), _rel(k_flat[slots], k_ref), _rel(v_flat[slots], v_ref))


def rotary_int8_case(dtype: str, head_dim: int, hq: int = 4, hkv: int = 2) -> dict[str, float]:
    """Online int8 into the cache: codes and (scale, zero) exactly KVCache.write's of the kernel's own rotated k and
    v (the rotation itself is checked against the reference above), other slots untouched."""
    import torch

    from lmd.turbomind.kernels.rotary import rotary_qkv_triton
    from lmd.turbomind.kv_cache import KVCache
    from lmd.turbomind.rope import rotary_qkv_reference

    dt, t = _dtype(dtype), 7
    g = torch.Generator().manual_seed(head_dim)
    qkv = (torch.randn(t, (hq + 2 * hkv) * head_dim, generator=g) * 3).to(dt)
    qkv[2, -head_dim:] = 0.25  # a constant V head: zero range, the scale's floor
    angles = torch.rand(t, head_dim // 2, generator=g) * 6
    cos, sin = torch.cat((angles, angles), -1).cos().to(dt), torch.cat((angles, angles), -1).sin().to(dt)
    q_ref, k_ref, v_ref = rotary_qkv_reference(qkv, cos, sin, hq, hkv, head_dim)
    ref = KVCache(1, 4, 4, hkv, head_dim, dt, torch.device("cpu"), int8=True)
    ours = KVCache(1, 4, 4, hkv, head_dim, dt, torch.device("cpu"), int8=True)
    for c in (ref, ours):
        for pool in (c.k[0], c.v[0]):
            pool.fill_(55)
        for pool in (c.k_param[0], c.v_param[0]):
            pool.fill_(-3.0)
    slots = torch.randperm(16, generator=g)[:t]
    _, k, v = rotary_qkv_triton(qkv, cos, sin, hq, hkv, head_dim)
    ref.write(0, k, v, slots)
    q, _, _ = rotary_qkv_triton(qkv, cos, sin, hq, hkv, head_dim, *ours.online_int8_slots(0)[:2], slots,
                                *ours.online_int8_slots(0)[2:])
    codes = max((a.int() - b.int()).abs().max().item() for a, b in ((ours.k[0], ref.k[0]), (ours.v[0], ref.v[0])))
    params = max((a.float() - b.float()).abs().max().item()
                 for a, b in ((ours.k_param[0], ref.k_param[0]), (ours.v_param[0], ref.v_param[0])))
    return {"q": _rel(q, q_ref), "params": params, "codes": codes, "k": _rel(k, k_ref)}


def qk_norm_case(dtype: str, head_dim: int, hq: int, hkv: int) -> dict[str, float]:
    """Per-head q/k RMSNorm in place on a fused projection whose rows are strided (a slice of a wider tensor):
    q and k heads against the reference, v and the columns around the slice untouched."""
    import torch

    from lmd.turbomind.kernels.head_rms_norm import qk_rms_norm_triton
    from lmd.turbomind.layers import qk_rms_norm_reference

    dt, t, width = _dtype(dtype), 5, (hq + 2 * hkv) * head_dim
    g = torch.Generator().manual_seed(head_dim + hq)
    wide = (torch.randn(t, width + 24, generator=g) * 3).to(dt)
    weight = (torch.rand(2, head_dim, generator=g) + 0.5).to(dt)
    before = wide.clone()
    ref = qk_rms_norm_reference(wide[:, 8: 8 + width].clone(), weight, hq, hkv, head_dim, 1e-6)
    out = qk_rms_norm_triton(wide[:, 8: 8 + width], weight, hq, hkv, head_dim, 1e-6)
    assert out.data_ptr() == wide[:, 8:].data_ptr(), "not in place"
    outside = torch.cat([wide[:, :8], wide[:, 8 + width:]], 1), torch.cat([before[:, :8], before[:, 8 + width:]], 1)
    qk = (hq + hkv) * head_dim
    return {"qk": _rel(out[:, :qk], ref[:, :qk]), "v": (out[:, qk:].float() - ref[:, qk:].float()).abs().max().item(),
            "outside": (outside[0].float() - outside[1].float()).abs().max().item()}


def qwen3_model_logits() -> float:
    """A tiny Qwen3 (per-head q/k norms, head_dim 128 != hidden / heads) with LMD_LAYER_OPS=triton vs reference."""
    import tempfile
    from pathlib import Path

    from tests.conftest import deploy_tiny
    from tests.turbomind.kernels.test_paged_attention_interpret import engine_logits

    with tempfile.TemporaryDirectory() as root:
        _, ws = deploy_tiny(Path(root), "qwen3", num_hidden_layers=1)
        os.environ["LMD_LAYER_OPS"] = "reference"
        ref = engine_logits(str(ws), "reference")
        os.environ["LMD_LAYER_OPS"] = "triton"
        out = engine_logits(str(ws), "reference")
        os.environ["LMD_LAYER_OPS"] = "reference"
    return ((out - ref).abs().max() / (ref.amax(-1) - ref.amin(-1)).max()).item()


def model_logits(ws: str) -> dict[str, float]:
    """A tiny model's logits (prefills, a decode beside a chunk, decodes) with LMD_LAYER_OPS=triton vs reference;
    float KV (RoPE kernel stores K/V) and online int8 KV (RoPE kernel, then KVCache.write)."""
    from tests.turbomind.kernels.test_paged_attention_interpret import engine_logits

    out = {}
    for name, overrides in (("model-fp32", {}), ("model-int8-online", {"quant_policy": 4})):
        os.environ["LMD_LAYER_OPS"] = "reference"
        ref = engine_logits(ws, "reference", **overrides)
        os.environ["LMD_LAYER_OPS"] = "triton"
        out_logits = engine_logits(ws, "reference", **overrides)
        os.environ["LMD_LAYER_OPS"] = "reference"
        out[name] = ((out_logits - ref).abs().max() / (ref.amax(-1) - ref.amin(-1)).max()).item()
    return out


NORM_CASES = {f"norm-{d}-h{h}-{'delta' if w else 'plain'}": (d, h, w)
              for d, h, w in (("fp32", 200, True), ("fp16", 96, False), ("fp16", 64, True), ("fp16", 1100, True))}
SILU_CASES = {f"silu-{d}-i{i}": (d, i) for d, i in (("fp32", 40), ("fp16", 1500))}
# head counts: 4 q / 2 kv (2 heads per program), 16 / 16 (8 per program, the cap), 6 / 3 (1 per program)
ROTARY_CASES = {f"rotary-{d}-d{hd}-rot{r}-{'cache' if c else 'out'}-h{hq}-{hkv}": (d, hd, r, c, hq, hkv)
                for d, hd, r, c, hq, hkv in (("fp32", 16, 16, False, 4, 2), ("fp16", 32, 16, False, 4, 2),
                                             ("fp16", 64, 64, True, 4, 2), ("fp32", 24, 8, True, 4, 2),
                                             ("fp16", 32, 32, True, 16, 16), ("fp32", 16, 8, True, 6, 3),
                                             ("fp16", 128, 96, True, 4, 2))}  # Phi-4-mini's three quarters


ROTARY_INT8_CASES = {f"rotary-int8-{d}-d{hd}-h{hq}-{hkv}": (d, hd, hq, hkv)
                     for d, hd, hq, hkv in (("fp32", 32, 4, 2), ("fp16", 64, 4, 2), ("fp16", 128, 4, 2),
                                            ("fp16", 32, 16, 8), ("fp32", 16, 6, 3))}

QK_NORM_CASES = {f"qk-norm-{d}-d{hd}-h{hq}-{hkv}": (d, hd, hq, hkv)
                 for d, hd, hq, hkv in (("fp32", 128, 4, 2), ("fp16", 64, 8, 8), ("fp16", 96, 6, 3))}


def main(ws: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    jobs = {**{n: (lambda a=a: norm_case(*a)) for n, a in NORM_CASES.items()},
            **{n: (lambda a=a: silu_case(*a)) for n, a in SILU_CASES.items()},
            **{n: (lambda a=a: rotary_case(*a)) for n, a in ROTARY_CASES.items()},
            **{n: (lambda a=a: rotary_int8_case(*a)) for n, a in ROTARY_INT8_CASES.items()},
            **{n: (lambda a=a: qk_norm_case(*a)) for n, a in QK_NORM_CASES.items()},
            "model": lambda: model_logits(ws), "model-qwen3": qwen3_model_logits}
    results = run_jobs(jobs)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])


@pytest.mark.parametrize("name", NORM_CASES)
def test_add_rms_norm_matches_reference(interpreted: dict, name: str) -> None:
    err = interpreted[name]
    assert isinstance(err, dict), err
    assert err["sum"] == 0.0, f"{name}: the residual sum differs by {err['sum']:.2e} (same rounding expected)"
    assert err["normed"] < ULP[NORM_CASES[name][0]] * 2, f"{name}: normed off by {err['normed']:.2e}"


@pytest.mark.parametrize("name", SILU_CASES)
def test_silu_mul_matches_reference(interpreted: dict, name: str) -> None:
    err = interpreted[name]
    assert isinstance(err, float), err
    assert err < ULP[SILU_CASES[name][0]] * 2, f"{name}: off by {err:.2e}"


@pytest.mark.parametrize("name", ROTARY_CASES)
def test_rotary_matches_reference(interpreted: dict, name: str) -> None:
    err = interpreted[name]
    assert isinstance(err, float), err
    assert err < ULP[ROTARY_CASES[name][0]] * 2, f"{name}: off by {err:.2e}"


@pytest.mark.parametrize("name", ROTARY_INT8_CASES)
def test_rotary_online_int8_write_matches_kv_cache_write(interpreted: dict, name: str) -> None:
    err = interpreted[name]
    assert isinstance(err, dict), err
    assert err["q"] < ULP[ROTARY_INT8_CASES[name][0]] * 2, f"{name}: q off by {err['q']:.2e}"
    assert err["k"] < ULP[ROTARY_INT8_CASES[name][0]] * 2, f"{name}: k off by {err['k']:.2e}"
    assert err["params"] == 0.0, f"{name}: scale/zero differ by {err['params']:.2e} (same operations expected)"
    assert err["codes"] == 0, f"{name}: codes differ by up to {err['codes']} (same operations expected)"


@pytest.mark.parametrize("name", QK_NORM_CASES)
def test_qk_rms_norm_matches_reference_in_place(interpreted: dict, name: str) -> None:
    err = interpreted[name]
    assert isinstance(err, dict), err
    assert err["qk"] < ULP[QK_NORM_CASES[name][0]] * 2, f"{name}: q/k heads off by {err['qk']:.2e}"
    assert err["v"] == 0.0 and err["outside"] == 0.0, f"{name}: wrote outside q and k ({err})"


def test_qwen3_logits_with_layer_kernels_match_the_reference(interpreted: dict) -> None:
    err = interpreted["model-qwen3"]
    assert isinstance(err, float), err
    assert err < 1e-5, f"logits differ by {err:.2e} of their range"


# int8 KV: a key that differs by one fp32 rounding can land on the neighbouring code (1/255 of its range)
@pytest.mark.parametrize(("name", "tol"), [("model-fp32", 1e-5), ("model-int8-online", 1e-4)])
def test_model_logits_with_layer_kernels_match_the_reference(interpreted: dict, name: str, tol: float) -> None:
    errors = interpreted["model"]
    assert isinstance(errors, dict), errors
    assert errors[name] < tol, f"{name}: logits differ by {errors[name]:.2e} of their range"


def test_unknown_layer_ops_choice_is_refused(monkeypatch) -> None:
    import torch

    from lmd.errors import LmdError
    from lmd.turbomind.layers import silu_mul

    monkeypatch.setenv("LMD_LAYER_OPS", "cuda")
    with pytest.raises(LmdError, match="LMD_LAYER_OPS='cuda'"):
        silu_mul(torch.zeros(1, 4))
