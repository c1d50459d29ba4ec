"""W8A8: `lmd smooth-quant` (SmoothQuant int8, FP8) -> compressed-tensors HF dir -> `lmd deploy` (weight_type int8 |
fp8) -> the engine's W8A8 linears (PyTorch reference path on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lmd.arch import ARCHITECTURES, decoder_layers, get_module
from lmd.deploy.converter import run_deploy
from lmd.deploy.workspace_reader import load_rank_tensors, read_workspace_config
from lmd.errors import LmdError
from lmd.lite.smooth_quant import smooth_model
from lmd.lite.smooth_quant_run import SmoothQuantConfig, smooth_quant
from lmd.turbomind.kernels.w8a8_reference import quantize_per_token_reference

ARCH = ARCHITECTURES["llama"]


def test_per_token_codes_by_hand():
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 1.0, -448 / 224, 0.1]])
    q, s = quantize_per_token_reference(x, torch.int8)
    assert q[0].tolist() == [127, -64, 32, 0]  # -63.5 rounds away from zero, 31.75 to 32
    assert q[1].tolist() == [0, 0, 0, 0] and s[1] > 0
    q8, s8 = quantize_per_token_reference(x, torch.float8_e4m3fn)
    assert q8[2].float().tolist() == [448.0, 224.0, -448.0, 22.0]  # 22.4 -> 22 (e4m3 step 2 between 16 and 32)
    assert torch.allclose(s8[2], torch.tensor(2 / 448))


def _tiny_model(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models("llama"), dtype=torch.float32).eval()


def _absmax_stats(model, ids) -> dict[str, torch.Tensor]:
    """absmax per input channel of every decoder linear (what lmd calibrate's inputs_stats.pth holds)."""
    stats, hooks = {}, []
    for i, layer in enumerate(decoder_layers(model, model.config)):
        for name in ARCH.linears:
            key = f"{ARCH.layers}.{i}.{name}"

            def hook(_m, args, key=key):
                stats[key] = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)

            hooks.append(get_module(layer, name).register_forward_pre_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return stats


def _with_outlier_channels(model):
    """Give the hidden state LLM-like outlier channels (SmoothQuant's premise): a few norm weights 40x larger."""
    with torch.no_grad():
        for layer in decoder_layers(model, model.config):
            for norm in (ARCH.attn_norm, ARCH.mlp_norm):
                get_module(layer, norm).weight[[3, 77]] *= 40
    return model


def _fake_w8a8_logits(model, ids, qdtype):
    """Logits with every decoder linear's weight per-channel quantized and its input per-token quantized."""
    from lmd.turbomind.kernels.w8a8_reference import quantize_weight_per_channel

    hooks = []
    with torch.no_grad():
        for layer in decoder_layers(model, model.config):
            for name in ARCH.linears:
                module = get_module(layer, name)
                q, s = quantize_weight_per_channel(module.weight, qdtype)
                module.weight.copy_(q.float() * s[:, None])

                def hook(_m, args):
                    x = args[0]
                    flat = x.reshape(-1, x.shape[-1])
                    codes, scale = quantize_per_token_reference(flat, qdtype)
                    return ((codes.float() * scale[:, None]).reshape(x.shape).to(x.dtype),)

                hooks.append(module.register_forward_pre_hook(hook))
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    return logits


def test_smoothing_keeps_the_float_model_and_helps_int8(tiny_models):
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(2))
    base = _with_outlier_channels(_tiny_model(tiny_models))
    with torch.no_grad():
        ref = base(ids).logits
    smoothed = _with_outlier_channels(_tiny_model(tiny_models))
    assert smooth_model(smoothed, ARCH, _absmax_stats(smoothed, ids), 0.5) == [0.5] * 8
    with torch.no_grad():
        torch.testing.assert_close(smoothed(ids).logits, ref, rtol=1e-4, atol=1e-4)  # the same float function
    err_plain = (_fake_w8a8_logits(base, ids, torch.int8) - ref).abs().mean()
    err_smooth = (_fake_w8a8_logits(smoothed, ids, torch.int8) - ref).abs().mean()
    assert err_smooth < 0.7 * err_plain, (err_smooth, err_plain)


@pytest.fixture(scope="module")
def calib_dir(tiny_models, tmp_path_factory):
    from lmd.lite.calibrate import CalibrateConfig, calibrate

    out = tmp_path_factory.mktemp("calib") / "stats"
    calibrate(CalibrateConfig(model=str(tiny_models("llama")), work_dir=str(out), calib_dataset="pydoc",
                              calib_samples=4, calib_seqlen=64))
    return out


def _smoothed_reference(src, calib_dir):
    """The float model smoothed with α 0.5 by calib_dir's statistics, embeddings and norms rounded to fp16 as the
    workspace holds them (the compute dtype); the linears stay fp32 for the caller to fake-quantize."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    smooth_model(reference, ARCH, torch.load(calib_dir / "inputs_stats.pth")["absmax"], 0.5)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.rpartition(".")[0].split(".", 3)[-1] not in ARCH.linears:
                param.copy_(param.half().float())
    return reference


def _engine_nll(workspace, ids: torch.Tensor) -> float:
    """Summed NLL of ids [L] through the engine at fp32 activations (the reference path's dtype)."""
    from lmd.turbomind.window_scorer import engine_window_scorer, scoring_engine

    engine = scoring_engine(str(workspace), seqlen=ids.numel(), dtype="fp32", max_context_token_num=32,
                            cache_block_seq_len=8)
    return engine_window_scorer(engine)(ids)


@pytest.mark.parametrize(("scheme", "qdtype"), [("int8", torch.int8), ("fp8", torch.float8_e4m3fn)])
def test_engine_nll_equals_fake_quantized_hf(tiny_models, calib_dir, tmp_path, scheme, qdtype):
    import torch.nn.functional as F

    src = tiny_models("llama")
    result = smooth_quant(SmoothQuantConfig(model=str(src), work_dir=str(tmp_path / "w8a8"), scheme=scheme,
                                            smooth=True, calib_dir=str(calib_dir), dtype="float32", ignore=()))
    assert result.smoothed and result.smoothed_groups == 8
    qc = json.loads((tmp_path / "w8a8" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["input_activations"] == {"num_bits": 8, "type": "int" if scheme == "int8"
                                                                   else "float", "symmetric": True,
                                                                   "strategy": "token", "dynamic": True}
    deployed = run_deploy("base", str(tmp_path / "w8a8"), str(tmp_path / "ws"), progress=False)
    assert deployed.weight_type == scheme and read_workspace_config(deployed.path).weight_type == scheme
    tensors = load_rank_tensors(deployed.path, 0)
    assert tensors["layers.0.attention.w_qkv.weight"].dtype == qdtype
    assert tensors["layers.0.feed_forward.w13.weight_scale"].shape == (512,)
    # reference: the float model smoothed by the same statistics, then fake-quantized
    reference = _smoothed_reference(src, calib_dir)
    ids = torch.randint(0, 49152, (48,), generator=torch.Generator().manual_seed(5))
    ours = _engine_nll(deployed.path, ids)
    ref = F.cross_entropy(_fake_w8a8_logits(reference, ids[None], qdtype)[0, :-1], ids[1:], reduction="sum").item()
    assert abs(ours - ref) < 1e-4 * abs(ref), (ours, ref)
    # served as deployed (the default dtype: the workspace's fp16 compute dtype), greedy tokens come out
    from lmd.turbomind.engine import Engine
    from lmd.turbomind.gen_config import GenerationConfig

    with Engine(deployed.path, cache_block_seq_len=8, cache_max_entry_count=32) as served:
        assert served.runner.dtype == torch.float16
        reply = served.generate([5, 6, 7], GenerationConfig(max_new_tokens=4, temperature=0, ignore_eos=True))
        assert len(reply.result().token_ids) == 4


def test_tp2_rank_files_hold_their_scales(tiny_models, calib_dir, tmp_path):
    smooth_quant(SmoothQuantConfig(model=str(tiny_models("llama")), work_dir=str(tmp_path / "w8a8"),
                                   calib_dir=str(calib_dir), ignore=()))
    ws = run_deploy("base", str(tmp_path / "w8a8"), str(tmp_path / "ws"), tp=2, progress=False).path
    whole = load_rank_tensors(run_deploy("base", str(tmp_path / "w8a8"), str(tmp_path / "ws1"),
                                         progress=False).path, 0)
    r0, r1 = load_rank_tensors(ws, 0), load_rank_tensors(ws, 1)
    assert torch.equal(r0["layers.1.feed_forward.w2.weight_scale"], whole["layers.1.feed_forward.w2.weight_scale"])
    assert torch.equal(torch.cat([r0["layers.1.feed_forward.w2.weight"], r1["layers.1.feed_forward.w2.weight"]], 1),
                       whole["layers.1.feed_forward.w2.weight"])
    assert r0["layers.1.feed_forward.w13.weight_scale"].shape == (256,)


def test_errors(tiny_models, tmp_path):
    src = str(tiny_models("llama"))
    with pytest.raises(LmdError, match="inputs_stats.pth is missing; run `lmd calibrate"):
        smooth_quant(SmoothQuantConfig(model=src, work_dir=str(tmp_path / "a"), calib_dir=str(tmp_path)))
    with pytest.raises(LmdError, match="--smooth-alpha 1.5 must be within"):
        SmoothQuantConfig(model=src, work_dir=str(tmp_path / "a"), alpha=1.5)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    run = subprocess.run([sys.executable, "-m", "lmd", "smooth-quant", src, "--work-dir", str(tmp_path / "full"),
                          "--fp8"], capture_output=True, text=True)
    assert run.returncode == 1 and "exists and is not empty; pass --force" in run.stderr
    fp8 = smooth_quant(SmoothQuantConfig(model=src, work_dir=str(tmp_path / "fp8"), scheme="fp8"))
    assert not fp8.smoothed and fp8.calib_dir is None  # FP8 needs no statistics unless --smooth
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(LmdError, match="dynamic per-token float activations"):
        run_deploy("base", str(tmp_path / "fp8"), str(tmp_path / "ws"), progress=False)


def test_alpha_search_prefers_migration_on_an_outlier_channel():
    from lmd.lite.smooth_quant import smooth_scales
    from lmd.lite.smooth_quant_search import GRID, best_alpha, group_error

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)
    x[:, 5] *= 60  # an activation outlier channel
    weight = torch.randn(32, 64, generator=g) * 0.05
    absmax = x.abs().amax(0)
    errors = {a: group_error(x, weight, smooth_scales(absmax, [weight], a), torch.int8) for a in GRID}
    chosen = best_alpha(x, weight, lambda a: smooth_scales(absmax, [weight], a), torch.int8)
    assert errors[chosen] == min(errors.values())
    assert chosen >= 0.4 and errors[chosen] < 0.5 * errors[GRID[0]]


def test_auto_alpha_end_to_end(tiny_models, calib_dir, tmp_path):
    from lmd.lite.smooth_quant_search import GRID

    run = subprocess.run([sys.executable, "-m", "lmd", "smooth-quant", str(tiny_models("llama")), "--work-dir",
                          str(tmp_path / "auto"), "--calib-dir", str(calib_dir), "--smooth-alpha", "auto",
                          "--search-samples", "2", "--calib-dataset", "pydoc", "--calib-seqlen", "64", "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["alpha"] == "auto" and len(result["alphas"]) == 8 and set(result["alphas"]) <= set(GRID)
    assert json.loads((tmp_path / "auto" / "smooth_quant.json").read_text())["alphas"] == result["alphas"]
    with pytest.raises(LmdError, match="--search-samples 2: .*only with --smooth-alpha auto"):
        SmoothQuantConfig(model="m", work_dir=str(tmp_path / "x"), search_samples=2)
