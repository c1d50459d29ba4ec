"""W8A8 beyond one α: `--smooth-alpha block` (α judged on the decoder layer's output) and `--ignore` (mixed
precision: the named linears stay 16-bit in the checkpoint, the workspace and the engine)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from contextlib import ExitStack

import pytest
import torch
import torch.nn.functional as F

from lmd.arch import decoder_layers
from lmd.deploy.converter import run_deploy
from lmd.deploy.workspace_reader import load_rank_tensors
from lmd.errors import LmdError
from lmd.lite.layerwise import capture_layer0_inputs, run_layer
from lmd.lite.smooth_quant import layer_groups, smooth_layer
from lmd.lite.smooth_quant_block import BLOCK_GRID, block_error, block_search_smooth, fake_w8a8, search_layer
from lmd.lite.smooth_quant_run import SmoothQuantConfig, smooth_quant
from tests.deploy import test_w8a8
from tests.deploy.test_w8a8 import (
    ARCH,
    _absmax_stats,
    _engine_nll,
    _fake_w8a8_logits,
    _smoothed_reference,
    _tiny_model,
    _with_outlier_channels,
)

calib_dir = test_w8a8.calib_dir  # the module-scoped calibration fixture, shared


def _fake_logits(model, ids, qdtype, keep: dict[int, set[str]]):
    with ExitStack() as stack, torch.no_grad():
        for i, layer in enumerate(decoder_layers(model, model.config)):
            stack.enter_context(fake_w8a8(layer, ARCH, qdtype, keep.get(i, ())))
        return model(ids).logits


def test_fake_w8a8_equals_the_test_helper_and_restores_weights(tiny_models):
    ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(1))
    model = _tiny_model(tiny_models)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ours = _fake_logits(model, ids, torch.int8, {})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    torch.testing.assert_close(ours, _fake_w8a8_logits(model, ids, torch.int8), rtol=0, atol=0)


def test_block_search_beats_alpha_half_on_the_block_error(tiny_models):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 49152, (2, 32), generator=g)
    model = _with_outlier_channels(_tiny_model(tiny_models))
    stats = _absmax_stats(model, ids)
    layer = decoder_layers(model, model.config)[0]
    inputs = capture_layer0_inputs(model, ids, "cpu", batch_size=2)
    reference = run_layer(layer, inputs, "cpu").hidden
    prefix = f"{ARCH.layers}.0."

    def error_at(alphas: list[float]) -> float:
        trial = copy.deepcopy(layer)
        smooth_layer(layer_groups(trial, model.config, ARCH, stats, prefix), alphas)
        return block_error(trial, ARCH, inputs, reference, torch.int8)

    chosen = search_layer(layer, lambda m: layer_groups(m, model.config, ARCH, stats, prefix), ARCH, inputs,
                          reference, torch.int8, BLOCK_GRID, ())
    assert set(chosen) <= set(BLOCK_GRID) and chosen != [0.5] * 4
    assert error_at(chosen) < error_at([0.5] * 4) < error_at([0.0] * 4)  # plain int8 (α 0) is worse still
    with torch.no_grad():
        ref_logits = model(ids).logits
    alphas = block_search_smooth(model, ARCH, stats, ids, torch.int8)
    assert alphas[:4] == chosen and len(alphas) == 8
    with torch.no_grad():  # smoothing by the searched αs keeps the float function
        torch.testing.assert_close(model(ids).logits, ref_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("scheme", "qdtype", "ignore", "keep"), [
    ("int8", torch.int8, ("down_proj",), {0: {ARCH.down}, 1: {ARCH.down}}),
    ("fp8", torch.float8_e4m3fn, ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
                                  "model.layers.1.self_attn.v_proj", "model.layers.0.mlp.down_proj"),
     {1: {ARCH.q, ARCH.k, ARCH.v}, 0: {ARCH.down}}),
])
def test_ignored_linears_deploy_and_match_the_fake_quantized_model(tiny_models, calib_dir, tmp_path, scheme, qdtype,
                                                                  ignore, keep):
    out = tmp_path / "w8a8"
    result = smooth_quant(SmoothQuantConfig(model=str(tiny_models("llama")), work_dir=str(out), scheme=scheme,
                                            smooth=True, calib_dir=str(calib_dir), dtype="float32", ignore=ignore))
    modules = [f"{ARCH.layers}.{i}.{lin}" for i in sorted(keep) for lin in ARCH.linears if lin in keep[i]]
    assert sorted(result.ignored) == sorted(modules)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", *result.ignored]
    ws = run_deploy("base", str(out), str(tmp_path / "ws"), progress=False).path
    tensors = load_rank_tensors(ws, 0)
    for i in range(2):
        w2 = f"layers.{i}.feed_forward.w2"
        assert (tensors[w2 + ".weight"].dtype == torch.float32) == (ARCH.down in keep.get(i, ()))  # --dtype float32
        assert (w2 + ".weight_scale" in tensors) == (ARCH.down not in keep.get(i, ()))
    # reference: the checkpoint's float model (smoothed, fp32) with the same linears fake-quantized
    reference = _smoothed_reference(tiny_models("llama"), calib_dir)
    ids = torch.randint(0, 49152, (48,), generator=torch.Generator().manual_seed(7))
    ours = _engine_nll(ws, ids)
    ref = F.cross_entropy(_fake_logits(reference, ids[None], qdtype, keep)[0, :-1], ids[1:], reduction="sum").item()
    assert abs(ours - ref) < 1e-4 * abs(ref), (ours, ref)


def test_bad_ignore_names_are_one_line_errors(tiny_models, tmp_path):
    src = str(tiny_models("llama"))
    for names, message in [(["gate"], "--ignore gate: not a decoder linear of this model; give one of q_proj"),
                           (["model.layers.2.mlp.down_proj"], "--ignore model.layers.2.mlp.down_proj: not a decoder"),
                           (["q_proj"], "--ignore: model.layers.0.self_attn.q_proj is fused with self_attn.k_proj, "
                                        "self_attn.v_proj in the engine; ignore them together"),
                           (["none", "o_proj"], "--ignore none quantizes every linear; drop it or the other")]:
        run = subprocess.run([sys.executable, "-m", "lmd", "smooth-quant", src, "--fp8", "--work-dir",
                              str(tmp_path / "x"), *[a for n in names for a in ("--ignore", n)]],
                             capture_output=True, text=True)
        assert run.returncode == 1 and message in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert not (tmp_path / "x").exists()


def test_deploy_refuses_a_fused_group_half_ignored(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "fp8"
    smooth_quant(SmoothQuantConfig(model=str(tiny_models("llama")), work_dir=str(out), scheme="fp8"))
    state = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj"
    state[f"{name}.weight"] = state[f"{name}.weight"].float() * state.pop(f"{name}.weight_scale")
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(LmdError, match=r"q_proj is quantized but model.layers.0.self_attn.k_proj, fused with it, is not"):
        run_deploy("base", str(out), str(tmp_path / "ws"), progress=False)


def test_int8_keeps_down_proj_by_default_and_ignore_none_quantizes_all(tiny_models, calib_dir, tmp_path):
    from safetensors.torch import load_file

    src = str(tiny_models("llama"))
    default = smooth_quant(SmoothQuantConfig(model=src, work_dir=str(tmp_path / "a"), calib_dir=str(calib_dir)))
    assert default.ignored == [f"{ARCH.layers}.{i}.{ARCH.down}" for i in range(2)]
    ws = run_deploy("base", str(tmp_path / "a"), str(tmp_path / "ws"), tp=2, progress=False).path
    ranks = [load_rank_tensors(ws, r) for r in range(2)]
    down = load_file(str(tmp_path / "a" / "model.safetensors"))[f"{ARCH.layers}.1.{ARCH.down}.weight"]
    assert down.dtype == torch.float16  # the checkpoint's --dtype; each rank holds its K half, no scale
    assert torch.equal(torch.cat([t["layers.1.feed_forward.w2.weight"] for t in ranks], 1), down)
    assert all("layers.1.feed_forward.w2.weight_scale" not in t for t in ranks)
    run = subprocess.run([sys.executable, "-m", "lmd", "smooth-quant", src, "--work-dir", str(tmp_path / "b"),
                          "--calib-dir", str(calib_dir), "--ignore", "none", "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["ignored"] == []
    assert json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]
    fp8 = smooth_quant(SmoothQuantConfig(model=src, work_dir=str(tmp_path / "c"), scheme="fp8"))
    assert fp8.ignored == []


def test_phi3_ignore_names_the_linears_of_its_llama_view(tiny_models, tmp_path):
    """Phi-3 is quantized as its Llama view (lmd.lite.llama_view): --ignore takes the view's q/k/v and gate/up, and the
    checkpoint keeps exactly those in 16 bits."""
    from safetensors.torch import load_file

    out = tmp_path / "w8a8"
    result = smooth_quant(SmoothQuantConfig(model=str(tiny_models("phi3")), work_dir=str(out), scheme="int8",
                                            dtype="float32", ignore=("q_proj", "k_proj", "v_proj")))
    assert sorted(result.ignored) == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "kqv"]
    tensors = load_file(str(out / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight_scale" not in tensors
    assert "model.layers.0.mlp.up_proj.weight_scale" in tensors
