"""Engine configuration: the model facts and the serving keys of a workspace's config.ini, plus caller overrides.

`ModelConfig` is what the weights were built for (fixed); `EngineConfig` holds the serving keys a user may edit in
config.ini or override per call (`Engine(ws, max_batch_size=8)`). Both are frozen; runtime facts (number of KV
blocks, eos ids) live in the objects that compute them, never here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from lmd.errors import LmdError
from lmd.workspace_format.config_ini import ROPE_TYPES, WEIGHT_TYPES
from lmd.workspace_format.rank_layout import RankShape


@dataclass(frozen=True)
class ModelConfig:
    model_name: str
    model_arch: str
    tensor_para_size: int
    head_num: int
    kv_head_num: int
    size_per_head: int
    hidden_units: int
    vocab_size: int
    num_layer: int
    inter_size: int
    norm_eps: float
    attn_bias: bool
    start_id: int
    end_ids: tuple[int, ...]
    weight_type: str
    group_size: int
    compute_dtype: str
    rotary_embedding: int
    rope_theta: float
    rope_scaling_type: str
    rope_scaling_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    original_max_position_embeddings: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (attention.q_norm / k_norm weights, Qwen3)
    rope_short_factor: tuple[float, ...] = ()  # longrope (Phi-3.5, Phi-4-mini), as config.ini
    rope_long_factor: tuple[float, ...] = ()
    rope_attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.weight_type not in WEIGHT_TYPES:
            raise LmdError(f"config.ini: weight_type={self.weight_type!r} is unknown; "
                           f"use one of {', '.join(WEIGHT_TYPES)}")
        if self.rope_scaling_type not in ROPE_TYPES:
            raise LmdError(f"config.ini: rope_scaling_type={self.rope_scaling_type!r} is unknown; "
                           f"use one of {', '.join(ROPE_TYPES)}")
        if self.head_num % self.kv_head_num:
            raise LmdError(f"config.ini: head_num={self.head_num} is not a multiple of kv_head_num={self.kv_head_num}")
        for name in ("head_num", "kv_head_num", "inter_size"):
            if getattr(self, name) % self.tensor_para_size:
                raise LmdError(f"config.ini: {name}={getattr(self, name)} is not divisible by "
                               f"tensor_para_size={self.tensor_para_size}; redeploy with another --tp")
        if self.weight_type == "int4" and self.group_size <= 0:
            raise LmdError("config.ini: weight_type=int4 needs group_size > 0; redeploy the workspace")

    @property
    def rank_shape(self) -> RankShape:
        return RankShape.of(self)

    @property
    def float_dtype(self) -> str:
        """The activation dtype: the weights' own for float weights, compute_dtype for quantized ones (int4, W8A8)."""
        return self.compute_dtype if self.weight_type in ("int4", "int8", "fp8") else self.weight_type


@dataclass(frozen=True)
class EngineConfig:
    session_len: int = 4096
    max_batch_size: int = 64
    max_context_token_num: int = 8192  # TurboMind's max_prefill_token_num: 64 prompts of 128 tokens in one step
    step_length: int = 16  # admission interval once the batch is full (scheduler.py, rule 4)
    cache_max_entry_count: float = 0.5
    cache_block_seq_len: int = 64
    cache_chunk_size: int = -1
    use_context_fmha: bool = True
    quant_policy: int = 0
    device: str = "auto"  # not in config.ini: "auto" picks cuda when available
    dtype: str = "auto"  # not in config.ini: "auto" keeps the workspace's compute dtype; else fp32/fp16/bf16
    tp: int = 1  # not in config.ini: tensor-parallel processes; any TP dividing the heads, whatever was deployed
    tp_rank: int = 0  # set by the engine for each rank's process
    pp: int = 1  # not in config.ini: pipeline stages (the decoder layers split in pp contiguous parts); tp * pp ranks
    pp_rank: int = 0  # set by the engine for each rank's process: its stage
    cuda_graph: bool = True  # not in config.ini: replay captured CUDA graphs for decode steps (CUDA, pp = 1)
    async_output: bool | None = None  # not in config.ini: stream a step's text while the next step runs; None: on
    # when the engine thread steps (a caller driving step() itself sees each step's deltas when it returns)
    enable_prefix_caching: bool = True  # not in config.ini: reuse the KV of full blocks shared by earlier prompts
    offload_weights_gb: float = 0.0  # not in config.ini: GiB of decoder-layer weights kept in host memory

    def __post_init__(self) -> None:
        positive = ("session_len", "max_batch_size", "max_context_token_num", "step_length", "cache_block_seq_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise LmdError(f"{name}={getattr(self, name)} must be > 0 (config.ini or engine option)")
        if self.cache_max_entry_count <= 0:
            raise LmdError(f"cache_max_entry_count={self.cache_max_entry_count} must be > 0: "
                           "a fraction of free memory (<= 1) or a number of blocks (> 1)")
        if self.quant_policy not in (0, 4):
            raise LmdError(f"quant_policy={self.quant_policy} is not supported; "
                           "use 0 (KV in the compute dtype) or 4 (KV int8)")
        if self.tp < 1:
            raise LmdError(f"tp={self.tp} must be >= 1 (1: one process; N: N tensor-parallel processes)")
        if self.pp < 1:
            raise LmdError(f"pp={self.pp} must be >= 1 (1: no pipeline; N: the layers split into N stages)")
        if not 0 <= self.pp_rank < self.pp:
            raise LmdError(f"pp_rank={self.pp_rank} but pp={self.pp}")
        if self.offload_weights_gb < 0:
            raise LmdError(f"offload_weights_gb={self.offload_weights_gb} must be >= 0 (GiB of layer weights kept in "
                           "host memory; 0: none)")
        if self.dtype not in ("auto", "fp32", "fp16", "bf16"):
            raise LmdError(f"dtype={self.dtype!r} is unknown; use auto, fp32, fp16 or bf16")


_ENGINE_INI_KEYS = {f.name for f in fields(EngineConfig)} - {"device", "dtype", "tp", "tp_rank", "pp", "pp_rank",
                                                             "cuda_graph",
                                                             "async_output", "enable_prefix_caching",
                                                             "offload_weights_gb"}


def read_config_ini(path: Path, overrides: dict[str, Any] | None = None) -> tuple[ModelConfig, EngineConfig]:
    """Split `[llama]` of config.ini into model facts and serving keys; `overrides` replace serving keys only.

    Parsing and validating the file is `lmd.workspace_format.config_ini`'s job (the one definition of the format)."""
    from lmd.workspace_format.config_ini import read_workspace_config

    if not path.is_file():
        raise LmdError(f"{path} not found; is this a workspace written by `lmd deploy`?")
    ini = read_workspace_config(path.parents[2])
    model_values = {f.name: getattr(ini, f.name) for f in fields(ModelConfig) if f.name != "end_ids"}
    model_values.update(end_ids=ini.end_id, attn_bias=bool(ini.attn_bias),
                        tie_word_embeddings=bool(ini.tie_word_embeddings), qk_norm=bool(ini.qk_norm))
    model = ModelConfig(**model_values)
    engine_kwargs: dict[str, Any] = {name: getattr(ini, name) for name in _ENGINE_INI_KEYS}
    engine_kwargs["use_context_fmha"] = bool(ini.use_context_fmha)
    unknown = sorted(set(overrides or {}) - {f.name for f in fields(EngineConfig)})
    if unknown:
        raise LmdError(f"unknown engine option(s) {', '.join(unknown)}; "
                       f"known: {', '.join(f.name for f in fields(EngineConfig))}")
    engine_kwargs.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return model, EngineConfig(**engine_kwargs)


def replace_engine(config: EngineConfig, **changes: Any) -> EngineConfig:
    return dataclasses.replace(config, **changes)

