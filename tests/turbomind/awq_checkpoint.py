"""Test helper: an AutoAWQ-format ("gemm") checkpoint made by round-to-nearest int4, plus its dequantized twin."""

from __future__ import annotations

from pathlib import Path

import torch

from lmd.arch import decoder_layers, get_arch, get_module
from lmd.turbomind.kernels.w4a16_layout import pack_awq_int32


def rtn_awq(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> (qweight [K, N/8], qzeros [K/g, N/8], scales fp16 [K/g, N], dequantized W [N, K] fp32)."""
    n, k = weight.shape
    w = weight.float().t().reshape(k // group_size, group_size, n)
    scale = ((w.amax(1) - w.amin(1)).clamp(min=1e-5) / 15).half().float()
    zero = torch.round(-w.amin(1) / scale).clamp(0, 15)
    codes = torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, 15)
    deq = ((codes - zero[:, None]) * scale[:, None]).reshape(k, n).t().contiguous()
    return (pack_awq_int32(codes.reshape(k, n).to(torch.int32)), pack_awq_int32(zero.to(torch.int32)),
            scale.half(), deq)


def write_awq_checkpoint(src: Path, dst: Path, group_size: int) -> torch.nn.Module:
    """Quantize every decoder linear of the HF model at `src` into an AWQ checkpoint at `dst`.
    Returns the fp32 HF model whose linears hold the dequantized weights (the reference)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    arch = get_arch(model.config)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    prefix = arch.layers
    for i, layer in enumerate(decoder_layers(model, model.config)):
        for name in arch.linears:
            module = get_module(layer, name)
            qweight, qzeros, scales, deq = rtn_awq(module.weight.data, group_size)
            key = f"{prefix}.{i}.{name}"
            del state[f"{key}.weight"]
            state.update({f"{key}.qweight": qweight, f"{key}.qzeros": qzeros, f"{key}.scales": scales})
            module.weight.data = deq
    dst.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    config.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm",
                                  "zero_point": True}
    config.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return model


def load_dequantized(awq_dir: Path) -> torch.nn.Module:
    """An AWQ gemm checkpoint (any producer) as an fp32 HF model whose linears hold the dequantized weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from lmd.turbomind.kernels.w4a16_layout import unpack_awq_int32

    config = AutoConfig.from_pretrained(awq_dir)
    group = int(config.quantization_config["group_size"])
    del config.quantization_config
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(awq_dir).glob("*.safetensors")):
        state.update(load_file(str(file)))
    dense = {}
    for name, tensor in state.items():
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            codes = unpack_awq_int32(tensor).float()  # [K, N]
            zeros = unpack_awq_int32(state[base + ".qzeros"]).float().repeat_interleave(group, 0)
            scales = state[base + ".scales"].float().repeat_interleave(group, 0)
            dense[base + ".weight"] = ((codes - zeros) * scales).t().contiguous()
        elif not name.endswith((".qzeros", ".scales")):
            dense[name] = tensor.float()
    model = AutoModelForCausalLM.from_config(config).float()
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
