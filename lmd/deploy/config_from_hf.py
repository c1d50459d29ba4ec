"""Derive the workspace's `[llama]` section from a Hugging Face config, tokenizer and generation config."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lmd.arch import get_arch, has_qkv_bias, partial_rotary_factor, rope_scaling, rope_theta
from lmd.errors import LmdError
from lmd.workspace_format.config_ini import ROPE_TYPES, WorkspaceConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


@dataclass(frozen=True)
class ModelDims:
    """Shapes of one decoder model, all ranks together."""

    head_num: int
    kv_head_num: int
    head_dim: int
    hidden: int
    inter: int
    num_layer: int
    vocab: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False
    rotary_dim: int = 0  # dims of each head RoPE rotates (its first ones); 0: the whole head

    @classmethod
    def from_config(cls, config: PretrainedConfig, where: str) -> ModelDims:
        get_arch(config)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise LmdError(f"{where}: hidden_act={config.hidden_act} is not supported (the engine's MLP is SiLU-gated)")
        if getattr(config, "mlp_bias", False):
            raise LmdError(f"{where}: mlp_bias=true is not supported (the workspace format has no MLP biases)")
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        if heads % kv_heads:
            raise LmdError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        return cls(head_num=heads, kv_head_num=kv_heads, head_dim=head_dim, hidden=int(config.hidden_size),
                   inter=int(config.intermediate_size), num_layer=int(config.num_hidden_layers),
                   vocab=int(config.vocab_size), tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   qkv_bias=has_qkv_bias(config), qk_norm=get_arch(config).qk_norm,
                   rotary_dim=_rotary_dim(head_dim, partial_rotary_factor(config), where))


def _rotary_dim(head_dim: int, factor: float, where: str) -> int:
    dim = int(head_dim * factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise LmdError(f"{where}: partial_rotary_factor={factor} rotates {dim} of {head_dim} head dims; the engine "
                       "needs an even number from 2 to the head dim")
    return dim


def session_len(config: PretrainedConfig) -> int:
    """max_position_embeddings, capped by an active sliding window: the engine attends over the full context, which
    matches the model exactly only while the context fits in the window."""
    length = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    active = getattr(config, "use_sliding_window", True)
    if window and active:
        length = min(length, int(window))
    return length


def end_ids(model_dir: str | None, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """EOS ids: generation_config.json first (chat models list several there), then config.json, then the tokenizer."""
    candidates: list[object] = []
    if model_dir and (Path(model_dir) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        with contextlib.suppress(OSError, ValueError):
            candidates.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    candidates += [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    for value in candidates:
        ids = value if isinstance(value, (list, tuple)) else [value]
        ids = tuple(int(i) for i in ids if i is not None)
        if ids:
            return ids
    raise LmdError("cannot find the EOS token id in generation_config.json, config.json or the tokenizer; "
                   "add eos_token_id to config.json")


def start_id(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> int:
    """BOS id, or -1 when the model has none (Qwen2)."""
    for value in (getattr(config, "bos_token_id", None), tokenizer.bos_token_id):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return -1


def rope_fields(config: PretrainedConfig, where: str) -> dict[str, object]:
    scaling = rope_scaling(config)
    rope_type = scaling.get("rope_type", "none")
    if rope_type not in ROPE_TYPES:
        raise LmdError(f"{where}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    max_pos = int(config.max_position_embeddings)
    original = int(scaling.get("original_max_position_embeddings") or getattr(config,
                                                                              "original_max_position_embeddings", 0)
                   or max_pos)
    fields: dict[str, object] = {
        "rope_theta": rope_theta(config),
        "rope_scaling_type": rope_type,
        "rope_scaling_factor": float(scaling.get("factor") or 1.0),
        "rope_low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
        "rope_high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
        "original_max_position_embeddings": original,
    }
    if rope_type == "longrope":  # transformers' _compute_longrope_parameters, its attention factor fixed here
        missing = [key for key in ("short_factor", "long_factor") if not scaling.get(key)]
        if missing:
            raise LmdError(f"{where}: longrope without {' and '.join(missing)} in rope_parameters; fix config.json")
        factor = float(scaling.get("factor") or max_pos / original)
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        fields.update(rope_scaling_factor=factor, rope_short_factor=tuple(float(v) for v in scaling["short_factor"]),
                      rope_long_factor=tuple(float(v) for v in scaling["long_factor"]),
                      rope_attention_factor=float(attention))
    return fields


def build_workspace_config(*, model_name: str, config: PretrainedConfig, dims: ModelDims,
                           tokenizer: PreTrainedTokenizerBase, model_dir: str | None, tp: int, weight_type: str,
                           group_size: int, compute_dtype: str, where: str) -> WorkspaceConfig:
    return WorkspaceConfig(
        model_name=model_name,
        model_arch=get_arch(config).model_type,
        tensor_para_size=tp,
        head_num=dims.head_num,
        kv_head_num=dims.kv_head_num,
        size_per_head=dims.head_dim,
        hidden_units=dims.hidden,
        vocab_size=dims.vocab,
        num_layer=dims.num_layer,
        inter_size=dims.inter,
        norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        attn_bias=int(dims.qkv_bias),
        start_id=start_id(config, tokenizer),
        end_id=end_ids(model_dir, config, tokenizer),
        session_len=session_len(config),
        weight_type=weight_type,
        group_size=group_size,
        compute_dtype=compute_dtype,
        rotary_embedding=dims.rotary_dim or dims.head_dim,
        max_position_embeddings=int(config.max_position_embeddings),
        tie_word_embeddings=int(dims.tie_word_embeddings),
        qk_norm=int(dims.qk_norm),
        **rope_fields(config, where),  # type: ignore[arg-type]
    )
