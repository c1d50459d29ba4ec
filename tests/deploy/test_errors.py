"""Every user-fixable deploy problem is one LmdError line naming the file or flag, and leaves no partial output."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from lmd.deploy import deploy
from lmd.errors import LmdError


def _copy(src, tmp_path, name="model"):
    return shutil.copytree(src, tmp_path / name)


def _no_leftovers(parent):
    return not [p for p in parent.iterdir() if ".lmd-tmp-" in p.name or ".lmd-old-" in p.name]


def test_unknown_model_name_lists_templates(tiny_models, tmp_path):
    with pytest.raises(LmdError, match="llama2, llama3, vicuna, internlm, qwen, mistral, base, hf"):
        deploy("gpt5", str(tiny_models()), str(tmp_path / "ws"), progress=False)


@pytest.mark.parametrize(("tp", "message"), [(3, "--tp 3 does not divide head_num=4, kv_head_num=2 and inter_size=256; "
                                                     "use --tp 1, 2$"), (0, "--tp 0 must be >= 1; use --tp 1, 2"),
                                             (4, "does not divide head_num=4, kv_head_num=2.*use --tp 1, 2")])
def test_bad_tp(tiny_models, tmp_path, tp, message):
    with pytest.raises(LmdError, match=message):
        deploy("base", str(tiny_models()), str(tmp_path / "ws"), tp=tp, progress=False)
    assert not (tmp_path / "ws").exists()


def test_awq_group_size_mismatch(tiny_awq, tmp_path):
    with pytest.raises(LmdError, match="--group-size 128 does not match .*group_size=64; pass --group-size 64"):
        deploy("base", str(tiny_awq("llama", 64)), str(tmp_path / "ws"), group_size=128, progress=False)


def test_awq_row_split_off_group_boundary(tiny_awq, tmp_path):
    with pytest.raises(LmdError, match="not multiples of group_size 128; use --tp 1"):
        deploy("base", str(tiny_awq("mistral", 128)), str(tmp_path / "ws"), group_size=128, tp=2, progress=False)


def test_awq_rejects_float32_compute(tiny_awq, tmp_path):
    with pytest.raises(LmdError, match="float32 is not a compute dtype"):
        deploy("base", str(tiny_awq("llama", 64)), str(tmp_path / "ws"), group_size=64, dtype="float32",
               progress=False)


@pytest.mark.parametrize(("flag", "message"), [("awq", "use --model-format hf"), ("gguf", "use --model-format hf")])
def test_format_flag_mismatch(tiny_models, tmp_path, flag, message):
    with pytest.raises(LmdError, match=message):
        deploy("base", str(tiny_models()), str(tmp_path / "ws"), model_format=flag, progress=False)


def test_awq_checkpoint_given_as_hf(tiny_awq, tmp_path):
    with pytest.raises(LmdError, match="quant_method=awq; use --model-format awq"):
        deploy("base", str(tiny_awq("llama", 64)), str(tmp_path / "ws"), model_format="hf", progress=False)


def test_existing_dst_needs_force(tiny_models, tmp_path):
    dst = tmp_path / "ws"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(LmdError, match="already exists and is not empty; pass --force"):
        deploy("base", str(tiny_models()), str(dst), progress=False)
    assert (dst / "keep.txt").read_text() == "mine"
    deploy("base", str(tiny_models()), str(dst), force=True, progress=False)
    assert not (dst / "keep.txt").exists()
    assert (dst / "triton_models" / "weights" / "model.rank0.safetensors").is_file()
    assert _no_leftovers(tmp_path)


def test_dst_inside_source_is_refused(tiny_models, tmp_path):
    src = _copy(tiny_models(), tmp_path)
    with pytest.raises(LmdError, match="contains the source model"):
        deploy("base", str(src), str(tmp_path), force=True, progress=False)
    assert (src / "config.json").is_file()


def test_missing_config(tiny_models, tmp_path):
    src = _copy(tiny_models(), tmp_path)
    (src / "config.json").unlink()
    with pytest.raises(LmdError, match="no config.json"):
        deploy("base", str(src), str(tmp_path / "ws"), progress=False)


def test_missing_weights(tiny_models, tmp_path):
    src = _copy(tiny_models(), tmp_path)
    (src / "model.safetensors").unlink()
    with pytest.raises(LmdError, match=r"no \*.safetensors or pytorch_model\*.bin weights"):
        deploy("base", str(src), str(tmp_path / "ws"), progress=False)
    assert not (tmp_path / "ws").exists()
    assert _no_leftovers(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tiny_models, tmp_path, damage):
    src = _copy(tiny_models(), tmp_path)
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 100)
    with pytest.raises(LmdError, match="model.safetensors: .*re-download or re-save"):
        deploy("base", str(src), str(tmp_path / "ws"), progress=False)
    assert not (tmp_path / "ws").exists()
    assert _no_leftovers(tmp_path)


def test_missing_tensor(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    src = _copy(tiny_models(), tmp_path)
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(LmdError, match="tensor model.layers.1.mlp.up_proj.weight is missing"):
        deploy("base", str(src), str(tmp_path / "ws"), progress=False)
    assert not (tmp_path / "ws").exists()
    assert _no_leftovers(tmp_path)


def test_shape_mismatch_with_config(tiny_models, tmp_path):
    src = _copy(tiny_models(), tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 512
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(LmdError, match=r"gate_proj.weight has shape \[256, 128\] but config.json implies \[512, 128\]"):
        deploy("base", str(src), str(tmp_path / "ws"), progress=False)


def test_unsupported_architecture(tiny_models, tmp_path):
    src = _copy(tiny_models(), tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "gpt2"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(LmdError, match="'gpt2' is not supported; supported: internlm3, llama, mistral, phi3, qwen"):
        deploy("base", str(src), str(tmp_path / "ws"), progress=False)


def test_hf_template_needs_tokenizer_chat_template(tiny_models, tmp_path):
    src = _copy(tiny_models(), tmp_path)
    (src / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(LmdError, match="tokenizer's chat_template, but the tokenizer of .* has none"):
        deploy("hf", str(src), str(tmp_path / "ws"), progress=False)


def test_missing_tokenizer_points_to_flag(tiny_models, tmp_path):
    src = _copy(tiny_models(), tmp_path)
    for path in src.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            path.unlink()
    with pytest.raises(LmdError, match="pass --tokenizer-path"):
        deploy("base", str(src), str(tmp_path / "ws"), progress=False)
    ws = deploy("base", str(src), str(tmp_path / "ws"), tokenizer_path=str(tiny_models()), progress=False)
    assert (ws / "triton_models" / "tokenizer" / "tokenizer.json").is_file()


def test_cli_prints_one_line_error_and_json(tiny_models, tmp_path):
    bad = subprocess.run([sys.executable, "-m", "lmd", "deploy", "nope", str(tiny_models()), "--dst-path",
                          str(tmp_path / "ws")], capture_output=True, text=True)
    assert bad.returncode == 1
    assert bad.stderr.strip().startswith("lmd: unknown model name 'nope'")
    assert len(bad.stderr.strip().splitlines()) == 1
    good = subprocess.run([sys.executable, "-m", "lmd", "deploy", "qwen", str(tiny_models()), "--dst-path",
                           str(tmp_path / "ws"), "--tp", "2", "--json"], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    result = json.loads(good.stdout)
    assert (result["weight_type"], result["tp"], result["model_format"]) == ("fp16", 2, "hf")
    assert result["size_bytes"] > 0


def test_fp16_overflow_suggests_bf16(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    src = _copy(tiny_models(), tmp_path)
    state = load_file(str(src / "model.safetensors"))
    state["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e6
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(LmdError, match="down_proj.weight has values beyond float16.s range; .*--dtype bfloat16"):
        deploy("base", str(src), str(tmp_path / "ws"), progress=False)
    deploy("base", str(src), str(tmp_path / "ws"), dtype="bfloat16", progress=False)
