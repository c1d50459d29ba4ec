"""Self-attention of one decoder layer: fused QKV (+bias), per-head q/k RMSNorm (Qwen3), RoPE, KV write into the
paged cache, paged attention, wo.

RoPE and the KV write (float or online int8) are one Triton kernel on CUDA (kernels/rotary.py, LMD_LAYER_OPS); the
PyTorch path (rope.rotary_qkv_reference, KVCache.write) is the CPU path and its oracle. A batch of MHA decodes wide
enough for the CUDA-core decode kernel folds RoPE and the KV write (float, online or static int8) into the
attention launch instead (paged_attention.rope_decode_attention, kernels/paged_decode.py). The q/k norms run first,
in place on the fused projection, so every one of these paths sees normalised heads."""

from __future__ import annotations

import torch

from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.kernel_choice import layer_kernel
from lmd.turbomind.kv_cache import KVCache
from lmd.turbomind.layers import qk_rms_norm
from lmd.turbomind.linear import Linear
from lmd.turbomind.paged_attention import paged_attention, rope_decode_attention
from lmd.turbomind.rope import rotary_qkv_reference


class Attention:
    def __init__(self, layer: int, w_qkv: Linear, wo: Linear, q_heads: int, kv_heads: int, head_dim: int,
                 fused: bool = True, qk_norm: torch.Tensor | None = None, eps: float = 1e-6) -> None:
        """`qk_norm`: [2, head_dim] weights (q's, then k's) of a per-head RMSNorm before RoPE (Qwen3), or None."""
        self.layer, self.w_qkv, self.wo, self.fused = layer, w_qkv, wo, fused
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.qk_norm, self.eps = qk_norm, eps
        self.scale = head_dim ** -0.5

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                 cache: KVCache) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qkv = self.w_qkv(x)
        if self.qk_norm is not None:
            qkv = qk_rms_norm(qkv, self.qk_norm, self.q_heads, self.kv_heads, d, self.eps)
        kernel = layer_kernel(qkv, "rotary")
        if (kernel is not None and qkv.stride(-1) == 1 and cos.shape[-1] % 2 == 0 and cos.is_contiguous()
                and sin.stride() == cos.stride()):
            out = rope_decode_attention(qkv, cos, sin, cache, self.layer, batch, self.scale, self.q_heads,
                                        self.kv_heads, self.fused)
            if out is not None:  # MHA decodes: RoPE, the KV write and the attention in one launch
                return self.wo(out.reshape(t, self.q_heads * d))
            slots = cache.float_slots(self.layer)  # float cache: K and V stored by the same kernel
            codes = cache.online_int8_slots(self.layer)  # online int8: quantized and stored by it too
            if slots is not None:
                q, _, _ = kernel.rotary_qkv_triton(qkv, cos, sin, self.q_heads, self.kv_heads, d, *slots, batch.slots)
            elif codes is not None:
                k_codes, v_codes, k_param, v_param = codes
                q, _, _ = kernel.rotary_qkv_triton(qkv, cos, sin, self.q_heads, self.kv_heads, d, k_codes, v_codes,
                                                   batch.slots, k_param, v_param)
            else:
                q, k, v = kernel.rotary_qkv_triton(qkv, cos, sin, self.q_heads, self.kv_heads, d)
                cache.write(self.layer, k, v, batch.slots)
        else:
            q, k, v = rotary_qkv_reference(qkv, cos, sin, self.q_heads, self.kv_heads, d)
            cache.write(self.layer, k, v, batch.slots)
        out = paged_attention(q, cache, self.layer, batch, self.scale, self.fused)
        return self.wo(out.reshape(t, self.q_heads * d))
