"""config.ini written by deploy matches the HF config, parses back, and honours hand edits."""

from __future__ import annotations

import json

import pytest

from lmd.deploy import deploy
from lmd.deploy.config_from_hf import rope_fields, session_len
from lmd.errors import LmdError
from lmd.workspace_format.config_ini import WorkspaceConfig, config_path, read_workspace_config

DOC_KEYS = ["model_name", "model_arch", "tensor_para_size", "head_num", "kv_head_num", "size_per_head", "hidden_units",
            "vocab_size", "num_layer", "inter_size", "norm_eps", "attn_bias", "start_id", "end_id", "session_len",
            "weight_type", "group_size", "compute_dtype", "rotary_embedding", "rope_theta", "rope_scaling_type",
            "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "original_max_position_embeddings",
            "max_position_embeddings", "max_batch_size", "max_context_token_num", "step_length",
            "cache_max_entry_count", "cache_block_seq_len", "cache_chunk_size", "use_context_fmha", "quant_policy",
            "tie_word_embeddings", "qk_norm", "rope_short_factor", "rope_long_factor", "rope_attention_factor"]


@pytest.fixture(scope="module")
def qwen_ws(tiny_models, tmp_path_factory):
    src = tiny_models("qwen2", rope_theta=12345.0, max_position_embeddings=777)
    return src, deploy("qwen", str(src), str(tmp_path_factory.mktemp("ws") / "ws"), tp=2, progress=False)


def test_every_documented_key_in_order(qwen_ws):
    _, ws = qwen_ws
    lines = config_path(ws).read_text().splitlines()
    assert lines[0] == "[llama]"
    assert [line.split(" = ")[0] for line in lines[1:]] == DOC_KEYS


def test_values_match_hf_config(qwen_ws):
    src, ws = qwen_ws
    hf = json.loads((src / "config.json").read_text())
    cfg = read_workspace_config(ws)
    assert (cfg.model_name, cfg.model_arch, cfg.tensor_para_size) == ("qwen", "qwen2", 2)
    assert (cfg.head_num, cfg.kv_head_num) == (hf["num_attention_heads"], hf["num_key_value_heads"])
    assert cfg.size_per_head == cfg.rotary_embedding == hf["hidden_size"] // hf["num_attention_heads"]
    assert (cfg.hidden_units, cfg.inter_size, cfg.num_layer) == (hf["hidden_size"], hf["intermediate_size"],
                                                                  hf["num_hidden_layers"])
    assert cfg.vocab_size == hf["vocab_size"]
    assert cfg.norm_eps == hf["rms_norm_eps"]
    assert cfg.attn_bias == 1
    assert (cfg.start_id, cfg.end_id) == (hf["bos_token_id"], (hf["eos_token_id"],))
    assert cfg.session_len == cfg.max_position_embeddings == 777
    assert cfg.rope_theta == 12345.0
    assert (cfg.rope_scaling_type, cfg.rope_scaling_factor) == ("none", 1.0)
    assert (cfg.weight_type, cfg.group_size, cfg.compute_dtype) == ("fp16", 0, "fp16")
    assert (cfg.max_batch_size, cfg.cache_max_entry_count, cfg.cache_block_seq_len, cfg.quant_policy) == (64, 0.5, 64, 0)
    assert cfg.tie_word_embeddings == int(hf["tie_word_embeddings"])


def test_engine_reader_parses_deploy_output(qwen_ws):
    from lmd.turbomind.config import read_config_ini

    _, ws = qwen_ws
    model, engine = read_config_ini(config_path(ws))
    assert model.end_ids == read_workspace_config(ws).end_id
    assert engine.session_len == 777


def test_hand_edits_are_read_back(qwen_ws, tmp_path):
    _, ws = qwen_ws
    text = config_path(ws).read_text().replace("quant_policy = 0", "quant_policy = 4")
    text = text.replace("use_context_fmha = 1", "use_context_fmha = 0").replace("end_id = 2", "end_id = 2,7")
    edited = tmp_path / "triton_models" / "weights"
    edited.mkdir(parents=True)
    (edited / "config.ini").write_text(text)
    cfg = read_workspace_config(tmp_path)
    assert (cfg.quant_policy, cfg.use_context_fmha, cfg.end_id) == (4, 0, (2, 7))


def test_bad_hand_edit_names_the_key(qwen_ws, tmp_path):
    _, ws = qwen_ws
    edited = tmp_path / "triton_models" / "weights"
    edited.mkdir(parents=True)
    (edited / "config.ini").write_text(config_path(ws).read_text().replace("max_batch_size = 64", "max_batch_size = x"))
    with pytest.raises(LmdError, match="max_batch_size"):
        read_workspace_config(tmp_path)


def test_ini_text_round_trip():
    cfg = WorkspaceConfig(model_name="llama3", model_arch="llama", tensor_para_size=1, head_num=8, kv_head_num=2,
                          size_per_head=64, hidden_units=512, vocab_size=1000, num_layer=2, inter_size=1024,
                          norm_eps=1e-5, attn_bias=0, start_id=-1, end_id=(128001, 128009), session_len=8192,
                          weight_type="int4", group_size=128, compute_dtype="bf16", rotary_embedding=64,
                          rope_theta=500000.0, rope_scaling_type="llama3", rope_scaling_factor=8.0,
                          rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, original_max_position_embeddings=8192,
                          max_position_embeddings=131072)
    assert "end_id = 128001,128009" in cfg.to_ini_text()


def test_rope_and_session_from_hf_config():
    from transformers import AutoConfig

    llama3 = AutoConfig.for_model("llama", max_position_embeddings=131072, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    fields = rope_fields(llama3, "m")
    assert fields == {"rope_theta": 500000.0, "rope_scaling_type": "llama3", "rope_scaling_factor": 8.0,
                      "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}
    mistral = AutoConfig.for_model("mistral", max_position_embeddings=32768, sliding_window=4096)
    assert session_len(mistral) == 4096
    proportional = AutoConfig.for_model("llama", rope_scaling={"rope_type": "proportional", "factor": 2.0})
    with pytest.raises(LmdError, match="rope type 'proportional' is not supported; supported: .*longrope"):
        rope_fields(proportional, "m")


def test_longrope_fields_fix_transformers_attention_factor():
    import math

    from transformers import AutoConfig

    phi = AutoConfig.for_model("phi3", hidden_size=64, num_attention_heads=16, max_position_embeddings=131072,
                               rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5], "long_factor": [4.0, 8.0],
        "original_max_position_embeddings": 4096})
    fields = rope_fields(phi, "m")
    assert fields["rope_scaling_type"] == "longrope" and fields["original_max_position_embeddings"] == 4096
    assert fields["rope_short_factor"] == (1.0, 1.5) and fields["rope_long_factor"] == (4.0, 8.0)
    assert fields["rope_scaling_factor"] == 32.0  # max_position_embeddings / original, as transformers takes it
    assert fields["rope_attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
