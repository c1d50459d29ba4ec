"""Check a rank's tensors against docs/workspace.md before any layer is built: one clear error, not a shape crash."""

from __future__ import annotations

import torch

from lmd.errors import LmdError
from lmd.turbomind.config import ModelConfig


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of one rank's file (int4 linears as qweight/scales/zeros; int8 / fp8 ones add
    weight_scale, which `check_weights` asks only of 8-bit weights: an ignored linear of a W8A8 workspace is a plain
    16-bit weight)."""
    r = cfg.tensor_para_size
    hq, hkv, d, h = cfg.head_num // r, cfg.kv_head_num // r, cfg.size_per_head, cfg.hidden_units
    inter = cfg.inter_size // r
    shapes: dict[str, tuple[int, ...]] = {"norm.weight": (h,)}
    linears = {"attention.w_qkv": ((hq + 2 * hkv) * d, h), "attention.wo": (h, hq * d),
               "feed_forward.w13": (2 * inter, h), "feed_forward.w2": (h, inter)}
    for i in range(cfg.num_layer):
        p = f"layers.{i}."
        shapes[p + "attention_norm.weight"] = (h,)
        shapes[p + "ffn_norm.weight"] = (h,)
        for name, (n, k) in linears.items():
            if cfg.weight_type == "int4":
                g = cfg.group_size
                shapes.update({f"{p}{name}.qweight": (k // 8, n), f"{p}{name}.scales": (k // g, n),
                               f"{p}{name}.zeros": (k // g, n)})
            else:
                shapes[f"{p}{name}.weight"] = (n, k)
            if cfg.weight_type in ("int8", "fp8"):
                shapes[f"{p}{name}.weight_scale"] = (n,)
        if cfg.attn_bias:
            shapes[p + "attention.w_qkv.bias"] = ((hq + 2 * hkv) * d,)
        if cfg.qk_norm:
            shapes[p + "attention.q_norm.weight"] = shapes[p + "attention.k_norm.weight"] = (d,)
    return shapes


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    for name, shape in expected_shapes(cfg).items():
        if name.endswith(".weight_scale") and _ignored_linear(weights, name.removesuffix("_scale")):
            if name in weights:
                raise LmdError(f"{source}: {name} belongs to a 16-bit (ignored) weight; redeploy the workspace")
            continue
        perm = name.removesuffix("qweight") + "perm"
        if name.endswith(".qweight") and perm in weights and tuple(weights[perm].shape) != (shape[0] * 8,):
            raise LmdError(f"{source}: {perm} has shape {tuple(weights[perm].shape)}, config.ini implies "
                           f"{(shape[0] * 8,)}; the weights and config.ini disagree, redeploy the workspace")
        if name not in weights:
            raise LmdError(f"{source}: tensor {name} is missing; redeploy the workspace with `lmd deploy`")
        if tuple(weights[name].shape) != shape:
            raise LmdError(f"{source}: {name} has shape {tuple(weights[name].shape)}, config.ini implies {shape}; "
                           "the weights and config.ini disagree, redeploy the workspace")
    for name in ["tok_embeddings.weight"] + ([] if cfg.tie_word_embeddings else ["output.weight"]):
        if name not in weights:
            raise LmdError(f"{source}: tensor {name} is missing"
                           + ("" if name != "output.weight" else " (config.ini says tie_word_embeddings = 0)"))
        rows, width = weights[name].shape
        if rows < cfg.vocab_size or width != cfg.hidden_units:
            raise LmdError(f"{source}: {name} has shape {(rows, width)}, expected [>= {cfg.vocab_size}, "
                           f"{cfg.hidden_units}]; redeploy the workspace")


def _ignored_linear(weights: dict[str, torch.Tensor], weight_name: str) -> bool:
    """A W8A8 workspace's linear kept in 16 bits (compressed-tensors `ignore`): its weight is a float type."""
    weight = weights.get(weight_name)
    return weight is not None and weight.is_floating_point() and weight.itemsize >= 2
