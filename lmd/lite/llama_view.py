"""A model whose checkpoint fuses q/k/v and gate/up (Phi-3, Phi-4) as the Llama model it equals, for lmd.lite.

AWQ, calibration and SmoothQuant hook, scale and quantize q/k/v and gate/up as separate linears (`ArchSpec.q`, ...).
Phi-3's decoder layer is Llama's with those projections fused by rows (q, k, v; gate, up) and full-width RoPE (its
longrope too: transformers' Llama takes any rope type), so the same weights in a LlamaForCausalLM compute the same
logits; lite runs on that view and writes its outputs (AutoAWQ and
W8A8 checkpoints) as Llama checkpoints, which `lmd deploy` (and other servers) read as such. The split rows are views
of the fused tensors: no copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmd.arch import get_arch, partial_rotary_factor
from lmd.errors import LmdError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

_SHARED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "head_dim",
                "original_max_position_embeddings",  # longrope's pretraining length (Phi-3.5)
                "sliding_window")  # transformers' Llama ignores it; kept so deploy caps session_len as for the source
# RoPE as transformers 5 keeps it, or (transformers 4) as its two older keys
_ROPE_KEYS = ("rope_parameters",)
_OLD_ROPE_KEYS = ("rope_theta", "rope_scaling")


def needs_llama_view(config: PretrainedConfig) -> bool:
    spec = get_arch(config)
    return bool(spec.qkv or spec.gate_up)


def llama_config(config: PretrainedConfig) -> PretrainedConfig:
    from transformers import LlamaConfig

    factor = partial_rotary_factor(config)
    if factor != 1.0:
        raise LmdError(f"{config.model_type} with partial_rotary_factor={factor}: lmd awq, calibrate and smooth-quant "
                       "run it as Llama, which rotates whole heads; deploy the float model instead")
    rope = _ROPE_KEYS if getattr(config, "rope_parameters", None) else _OLD_ROPE_KEYS
    values = {key: getattr(config, key) for key in (*_SHARED_KEYS, *rope) if getattr(config, key, None) is not None}
    return LlamaConfig(**values, attention_bias=False, mlp_bias=False, dtype=getattr(config, "dtype", None))


def as_llama(model: PreTrainedModel) -> PreTrainedModel:
    """`model` itself when its linears are separate already, else the LlamaForCausalLM over the same tensors."""
    if not needs_llama_view(model.config):
        return model
    from transformers import LlamaForCausalLM

    spec, config = get_arch(model.config), model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q_rows = config.num_attention_heads * head_dim
    kv_rows = (config.num_key_value_heads or config.num_attention_heads) * head_dim
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if spec.qkv and module.endswith("." + spec.qkv):
            prefix = module.removesuffix(spec.qkv)
            for part, rows in zip((spec.q, spec.k, spec.v), tensor.split([q_rows, kv_rows, kv_rows]), strict=True):
                state[f"{prefix}{part}.{leaf}"] = rows
        elif spec.gate_up and module.endswith("." + spec.gate_up):
            prefix = module.removesuffix(spec.gate_up)
            gate, up = tensor.chunk(2)
            state[f"{prefix}{spec.gate}.{leaf}"], state[f"{prefix}{spec.up}.{leaf}"] = gate, up
        else:
            state[name] = tensor
    llama_cfg = llama_config(config)
    with torch.device("meta"):  # the weights come from `model` (assign=True): nothing is allocated twice
        llama = LlamaForCausalLM(llama_cfg)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    llama.load_state_dict(state, strict=not config.tie_word_embeddings, assign=True)
    if config.tie_word_embeddings:
        llama.tie_weights()
    llama.model.rotary_emb = type(llama.model.rotary_emb)(config=llama_cfg)  # its inv_freq, made on meta above
    return llama.eval()
