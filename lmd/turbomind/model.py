"""The Llama-family model (every architecture of lmd.arch) over a flat batch of tokens and the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmd.turbomind.attention import Attention
from lmd.turbomind.config import ModelConfig
from lmd.turbomind.forward_batch import ForwardBatch
from lmd.turbomind.kv_cache import KVCache
from lmd.turbomind.layers import GatedMLP, add_rms_norm
from lmd.turbomind.linear import cpu_linear, make_linear
from lmd.turbomind.rope import RotaryEmbedding
from lmd.turbomind.weight_offload import LayerOffload, OffloadPlan

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class DecoderLayer:
    """`reduce` sums the ranks' partial outputs of the row-split wo and w2 (tensor parallelism; one rank: identity)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], i: int, dtype: torch.dtype,
                 fused_attention: bool = True, reduce: Reduce = _no_reduce, cache_layer: int | None = None) -> None:
        """`cache_layer`: this layer's index in the KV cache (a pipeline stage's cache holds its layers only)."""
        p, r = f"layers.{i}.", cfg.tensor_para_size
        self.eps, self.reduce = cfg.norm_eps, reduce
        self.attention_norm = weights[p + "attention_norm.weight"].to(dtype)
        self.ffn_norm = weights[p + "ffn_norm.weight"].to(dtype)
        qk_norm = (torch.stack([weights[p + "attention.q_norm.weight"], weights[p + "attention.k_norm.weight"]])
                   .to(dtype) if cfg.qk_norm else None)
        self.attention = Attention(i if cache_layer is None else cache_layer,
                                   make_linear(weights, p + "attention.w_qkv", dtype),
                                   make_linear(weights, p + "attention.wo", dtype),
                                   cfg.head_num // r, cfg.kv_head_num // r, cfg.size_per_head, fused_attention,
                                   qk_norm, cfg.norm_eps)
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
                 offload: OffloadPlan | None = None, layers: range | None = None) -> None:
        """`offload`: the layers whose linear weights stay in host memory (weight_offload; their tensors in
        `weights` are host tensors, every other one is on `device`). `layers`: a pipeline stage's decoder layers
        (the embedding only with the first, the norm and lm_head only with the last; `weights` needs no others)."""
        self.cfg, self.dtype = cfg, dtype
        layers = range(cfg.num_layer) if layers is None else layers
        self.first, self.last = layers.start == 0, layers.stop == cfg.num_layer
        tied = cfg.tie_word_embeddings
        self.embed = weights["tok_embeddings.weight"].to(dtype) if self.first or (self.last and tied) else None
        self.norm = weights["norm.weight"].to(dtype) if self.last else None
        self.lm_head = (self.embed if tied else weights["output.weight"].to(dtype)) if self.last else None
        self.layers = [DecoderLayer(cfg, weights, i, dtype, fused_attention, reduce, cache_layer=i - layers.start)
                       for i in layers]
        self.rope = RotaryEmbedding(cfg, device)
        self.offload = LayerOffload(self.layers, offload, device) if offload is not None and offload.layers else None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """-> fp32 logits [len(batch.logit_indices), vocab_size] (padding rows of the embedding dropped)."""
        h = self.hidden_states(batch, cache)[batch.logit_indices]
        return self.logits(h)

    def hidden_states(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Final-normed hidden states [T, H] of every token of the batch (writes their KV into the cache)."""
        h, delta = self.run_layers(batch, cache)
        return self.final_norm(h, delta)

    def run_layers(self, batch: ForwardBatch, cache: KVCache,
                   carry: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This model's decoder layers over the batch: from the embedding (first stage) or from `carry`, the
        previous stage's (residual stream, MLP output not yet added); returns the same pair after the last layer."""
        h, delta = (self.embed[batch.input_ids], None) if carry is None else carry  # type: ignore[index]
        cos, sin = self.rope.cos_sin(batch.positions, batch.token_seq_lens, self.dtype)
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
        return h, delta  # type: ignore[return-value]

    def final_norm(self, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        return add_rms_norm(h, delta, self.norm, self.cfg.norm_eps)[1]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        # SmolLM2's 49152 x 576 head on one thread: 23 / 35 ms for 2 / 3 rows through F.linear, 6 / 9 swapped
        return cpu_linear(h, self.lm_head[: self.cfg.vocab_size]).float()
