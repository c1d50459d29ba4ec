"""The Llama-family model (llama, mistral, qwen2) over a flat batch of tokens and the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmd.turbomind.attention import Attention
from lmd.turbomind.config import ModelConfig
from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.kv_cache import KVCache
from lmd.turbomind.layers import GatedMLP, add_rms_norm
from lmd.turbomind.linear import make_linear
from lmd.turbomind.rope import RotaryEmbedding
from lmd.turbomind.weight_offload import LayerOffload, OffloadPlan

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class DecoderLayer:
    """`reduce` sums the ranks' partial outputs of the row-split wo and w2 (tensor parallelism; one rank: identity)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], i: int, dtype: torch.dtype,
                 fused_attention: bool = True, reduce: Reduce = _no_reduce) -> None:
        p, r = f"layers.{i}.", cfg.tensor_para_size
        self.eps, self.reduce = cfg.norm_eps, reduce
        self.attention_norm = weights[p + "attention_norm.weight"].to(dtype)
        self.ffn_norm = weights[p + "ffn_norm.weight"].to(dtype)
        self.attention = Attention(i, make_linear(weights, p + "attention.w_qkv", dtype),
                                   make_linear(weights, p + "attention.wo", dtype),
                                   cfg.head_num // r, cfg.kv_head_num // r, cfg.size_per_head, fused_attention)
        self.mlp = GatedMLP(make_linear(weights, p + "feed_forward.w13", dtype),
                            make_linear(weights, p + "feed_forward.w2", dtype))

    def __call__(self, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 batch: ForwardBatch, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, the previous layer's MLP output not yet added) -> the same pair after this layer: each
        residual add happens inside the next norm (one kernel on CUDA)."""
        h, x = add_rms_norm(h, delta, self.attention_norm, self.eps)
        h, x = add_rms_norm(h, self.reduce(self.attention(x, cos, sin, batch, cache)), self.ffn_norm, self.eps)
        return h, self.reduce(self.mlp(x))


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, fused_attention: bool = True, reduce: Reduce = _no_reduce,
                 offload: OffloadPlan | None = None) -> None:
        """`offload`: the layers whose linear weights stay in host memory (weight_offload; their tensors in
        `weights` are host tensors, every other one is on `device`)."""
        self.cfg, self.dtype = cfg, dtype
        self.embed = weights["tok_embeddings.weight"].to(dtype)
        self.norm = weights["norm.weight"].to(dtype)
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["output.weight"].to(dtype)
        self.layers = [DecoderLayer(cfg, weights, i, dtype, fused_attention, reduce) for i in range(cfg.num_layer)]
        self.rope = RotaryEmbedding(cfg, device)
        self.offload = LayerOffload(self.layers, offload, device) if offload is not None and offload.layers else None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """-> fp32 logits [len(batch.logit_indices), vocab_size] (padding rows of the embedding dropped)."""
        h = self.hidden_states(batch, cache)[batch.logit_indices]
        return self.logits(h)

    def hidden_states(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Final-normed hidden states [T, H] of every token of the batch (writes their KV into the cache)."""
        h = self.embed[batch.input_ids]
        cos, sin = self.rope.cos_sin(batch.positions, batch.token_seq_lens, self.dtype)
        delta = None
        offload = self.offload
        if offload is None:
            for layer in self.layers:
                h, delta = layer(h, delta, cos, sin, batch, cache)
        else:
            offload.start()
            for i, layer in enumerate(self.layers):
                offload.before(i)
                h, delta = layer(h, delta, cos, sin, batch, cache)
                offload.after(i)
            offload.finish()
        return add_rms_norm(h, delta, self.norm, self.cfg.norm_eps)[1]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.lm_head[: self.cfg.vocab_size]).float()
