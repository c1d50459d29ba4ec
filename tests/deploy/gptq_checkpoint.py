"""GPTQ (v1 / v2) and compressed-tensors pack-quantized checkpoints packed by hand from float weights.

The packers here are written from the formats' descriptions (plain shifts over Python-visible words), independent of
lmd.deploy's unpackers, so a nibble order or zero-point convention wrong in one shows up against the other. Codes
come from round-to-nearest with GPTQ's grid (min/max widened to include 0; symmetric: z = 8); act-order assigns the
input channels to groups through a random permutation, as GPTQ's desc_act does through the Hessian's diagonal.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from lmd.arch import ARCHITECTURES


@dataclass(frozen=True)
class Scheme:
    fmt: str = "gptq"  # gptq | compressed-tensors
    group_size: int = 64  # -1: per channel
    sym: bool = False
    act_order: bool = False
    v1: bool = True  # gptq only: checkpoint_format "gptq" (zeros stored minus one) vs "gptq_v2"


@dataclass(frozen=True)
class Quantized:
    codes: torch.Tensor  # int64 [K, N] 0..15
    scales: torch.Tensor  # fp16 [G, N]
    zeros: torch.Tensor  # int64 [G, N] 0..15
    g_idx: torch.Tensor  # int64 [K]

    def dequantize(self) -> torch.Tensor:
        """W [N, K] = (q - z[g]) * s[g], g the group of each input channel."""
        per_channel_scale = self.scales.float().index_select(0, self.g_idx)  # [K, N]
        per_channel_zero = self.zeros.float().index_select(0, self.g_idx)
        return ((self.codes.float() - per_channel_zero) * per_channel_scale).t().contiguous()


def quantize(weight: torch.Tensor, scheme: Scheme, seed: int = 0) -> Quantized:
    n, k = weight.shape
    g = k if scheme.group_size == -1 else scheme.group_size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if scheme.act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // g
    w = weight.float()
    groups = k // g
    scales, zeros = torch.empty(groups, n), torch.empty(groups, n, dtype=torch.int64)
    codes = torch.empty(k, n, dtype=torch.int64)
    for group in range(groups):
        members = (g_idx == group).nonzero().flatten()
        block = w[:, members]  # [N, g]
        lo, hi = block.amin(dim=1).clamp(max=0), block.amax(dim=1).clamp(min=0)
        if scheme.sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        zero = torch.full((n,), 8, dtype=torch.int64) if scheme.sym else torch.round(-lo / scale).long().clamp(0, 15)
        q = torch.clamp(torch.round(block / scale[:, None]) + zero[:, None], 0, 15).long()
        codes[members] = q.t()
        scales[group], zeros[group] = scale, zero
    return Quantized(codes, scales.half(), zeros, g_idx)


def pack_words(values: torch.Tensor) -> torch.Tensor:
    """int64 [..., 8m] (0..15) -> int32 [..., m]: value i of each eight at bits 4i (low nibble first)."""
    grouped = values.reshape(*values.shape[:-1], -1, 8)
    words = torch.zeros(grouped.shape[:-1], dtype=torch.int64)
    for i in range(8):
        words += grouped[..., i] << (4 * i)
    return as_int32(words)


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_tensors(q: Quantized, v1: bool) -> dict[str, torch.Tensor]:
    qweight = pack_words(q.codes.t()).t().contiguous()  # along K: [K/8, N]
    qzeros = pack_words(q.zeros)  # along N: [G, N/8]
    if v1:  # GPTQModel's v2 -> v1 save: one integer subtraction per word (a zero of 0 borrows from the next nibble)
        qzeros = as_int32(qzeros.to(torch.int64) - 0x11111111)
    return {"qweight": qweight, "qzeros": qzeros, "scales": q.scales, "g_idx": q.g_idx.to(torch.int32)}


def pack_quantized_tensors(q: Quantized, sym: bool, act_order: bool) -> dict[str, torch.Tensor]:
    k, n = q.codes.shape
    # values are stored offset by 8 (signed q + 8), which for GPTQ's unsigned grid is the code itself
    out = {"weight_packed": pack_words(q.codes.t()), "weight_scale": q.scales.t().contiguous(),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not sym:
        out["weight_zero_point"] = pack_words(q.zeros).t().contiguous()  # along N: [N/8, G]
    if act_order:
        out["weight_g_idx"] = q.g_idx.to(torch.int32)
    return out


def quantization_config(scheme: Scheme) -> dict:
    if scheme.fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": scheme.group_size, "sym": scheme.sym,
                "desc_act": scheme.act_order, "checkpoint_format": "gptq" if scheme.v1 else "gptq_v2"}
    weights = {"num_bits": 4, "type": "int", "symmetric": scheme.sym, "dynamic": False,
               "strategy": "channel" if scheme.group_size == -1 else "group",
               "group_size": None if scheme.group_size == -1 else scheme.group_size,
               "actorder": "group" if scheme.act_order else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"]}


def build_checkpoint(src: Path, dst: Path, scheme: Scheme) -> tuple[Path, dict[str, torch.Tensor]]:
    """(checkpoint dir, the HF state dict of its dequantized weights in fp32) for the HF model at `src`."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    arch = ARCHITECTURES[config["model_type"]]
    state = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in sorted(state.items()):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.split(".", 3)[-1] in arch.linears:
            # q/k/v and gate/up see the same inputs, so GPTQ gives them the same act-order (same seed per layer)
            q = quantize(tensor, scheme, seed=_order_seed(module, arch))
            packed = gptq_tensors(q, scheme.v1) if scheme.fmt == "gptq" else pack_quantized_tensors(
                q, scheme.sym, scheme.act_order)
            out.update({f"{module}.{key}": value for key, value in packed.items()})
            reference[name] = q.dequantize()
        else:
            out[name] = tensor.half()
            reference[name] = tensor.half().float()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = quantization_config(scheme)
    config["dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(config))
    for path in src.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens", "generation_config")):
            shutil.copy(path, dst / path.name)
    return dst, reference


def _order_seed(module: str, arch) -> int:
    layer = int(module.split(".")[2])
    leaf = module.split(".", 3)[-1]
    shared_input = {arch.q: 0, arch.k: 0, arch.v: 0, arch.o: 1, arch.gate: 2, arch.up: 2, arch.down: 3}
    return 10 * layer + shared_input[leaf]
