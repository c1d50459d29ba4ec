"""Architecture registry: which modules of a decoder layer are norms and linears, and which linears each norm feeds.

AWQ (scale groups), calibration (hooks) and deploy (fusing QKV and gate/up) all read this one table, so a new model
family is added here once. `tests/test_arch.py` checks every entry against a real transformers model class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmd.errors import LmdError

if TYPE_CHECKING:
    import torch.nn as nn
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    attn_norm: str = "input_layernorm"
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    attn: str = "self_attn"
    mlp_norm: str = "post_attention_layernorm"
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    mlp: str = "mlp"
    qkv_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before RoPE (Qwen3), weight [head_dim]
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    qkv: str = ""  # the checkpoint's fused q/k/v projection (rows q, k, v), or "" when they are three linears
    gate_up: str = ""  # the checkpoint's fused gate/up projection (rows gate, up), or ""

    @property
    def linears(self) -> tuple[str, ...]:
        """The linears of a decoder layer as the model holds them (fused ones as one)."""
        attention = (self.qkv,) if self.qkv else (self.q, self.k, self.v)
        mlp = (self.gate_up,) if self.gate_up else (self.gate, self.up)
        return (*attention, self.o, *mlp, self.down)


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama"),
    "mistral": ArchSpec("mistral"),
    "qwen2": ArchSpec("qwen2", qkv_bias=True),
    "qwen3": ArchSpec("qwen3", qk_norm=True),
    "internlm3": ArchSpec("internlm3"),  # transformers runs it as LlamaForCausalLM
    # Phi-3 / Phi-4: Llama's layer with fused projections; lmd.lite works on its Llama view (lmd.lite.llama_view)
    "phi3": ArchSpec("phi3", qkv="self_attn.qkv_proj", gate_up="mlp.gate_up_proj"),
}


def get_arch(config: PretrainedConfig) -> ArchSpec:
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise LmdError(f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))} "
                       "(Llama 1/2/3 and SmolLM are 'llama', Qwen2.5 is 'qwen2', Phi-4 is 'phi3')")
    return ARCHITECTURES[model_type]


def has_qkv_bias(config: PretrainedConfig) -> bool:
    return get_arch(config).qkv_bias or bool(getattr(config, "attention_bias", False))


def get_module(root: nn.Module, dotted: str) -> nn.Module:
    module = root
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def decoder_layers(model: nn.Module, config: PretrainedConfig) -> nn.ModuleList:
    return get_module(model, get_arch(config).layers)  # type: ignore[return-value]


def rope_theta(config: PretrainedConfig) -> float:
    """transformers 5 moved rope_theta into rope_parameters; read both (SmolLM2's 100000 must survive)."""
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


def partial_rotary_factor(config: PretrainedConfig) -> float:
    """The share of each head RoPE rotates (its first dims; Phi-4-mini's 0.75), from either config generation."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0)


def rope_scaling(config: PretrainedConfig) -> dict:
    """The rope scaling dict ({} for plain RoPE) with a 'rope_type' key, from either config generation."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return {}
    params["rope_type"] = rope_type
    return params
