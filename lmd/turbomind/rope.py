"""Rotary position embedding with the model's scaling (none, linear, dynamic NTK, llama3, yarn, longrope).

Frequencies are computed in fp32 exactly as transformers does, so the engine's logits match HF. Layout is the
"rotate half" convention of HF Llama: dims [0, D/2) pair with [D/2, D).
"""

from __future__ import annotations

import math

import torch

from lmd.turbomind.config import ModelConfig


class RotaryEmbedding:
    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        self.dim = cfg.rotary_embedding or cfg.size_per_head
        self.base = cfg.rope_theta
        self.kind = cfg.rope_scaling_type
        self.factor = cfg.rope_scaling_factor
        self.max_position_embeddings = cfg.max_position_embeddings
        self.attention_scaling = 1.0
        inv_freq = self._base_inv_freq(self.base, device)
        if self.kind == "linear":
            inv_freq = inv_freq / self.factor
        elif self.kind == "llama3":
            inv_freq = _llama3(inv_freq, self.factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                               cfg.original_max_position_embeddings)
        elif self.kind == "yarn":
            inv_freq, self.attention_scaling = _yarn(self.dim, self.base, self.factor,
                                                     cfg.original_max_position_embeddings, device)
        elif self.kind == "longrope":
            inv_freq = self._longrope_inv_freq(cfg.rope_short_factor, device)
            self.long_inv_freq = self._longrope_inv_freq(cfg.rope_long_factor, device)
            self.original_max = cfg.original_max_position_embeddings
            self.attention_scaling = cfg.rope_attention_factor
        self.inv_freq = inv_freq

    def _longrope_inv_freq(self, factors: tuple[float, ...], device: torch.device) -> torch.Tensor:
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64, device=device).float() / self.dim
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * self.base ** exponents)

    def _base_inv_freq(self, base: float | torch.Tensor, device: torch.device) -> torch.Tensor:
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64, device=device).float() / self.dim
        return 1.0 / (base ** exponents)

    def cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, dim]. `seq_lens` [T] (each token's sequence length) drives dynamic NTK and
        longrope."""
        inv_freq = self.inv_freq.to(positions.device)
        if self.kind == "dynamic" and seq_lens is not None:
            inv_freq = self._dynamic_inv_freq(seq_lens)  # [T, dim/2]
        elif self.kind == "longrope" and seq_lens is not None:  # the long factors once a sequence is past the
            # pretraining length (transformers decides per forward by its longest position: the same for a whole
            # prompt or a decode step)
            inv_freq = torch.where((seq_lens > self.original_max)[:, None], self.long_inv_freq.to(positions.device),
                                   inv_freq)
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def _dynamic_inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        # Per sequence, the base grows with its length past max_position_embeddings (HF's dynamic NTK formula).
        length = seq_lens.float().clamp(min=self.max_position_embeddings)
        ratio = self.factor * length / self.max_position_embeddings - (self.factor - 1)
        base = self.base * ratio ** (self.dim / (self.dim - 2))
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64, device=seq_lens.device).float() / self.dim
        return 1.0 / (base[:, None] ** exponents[None, :])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, rot_dim] with rot_dim <= D (partial rotary leaves the tail as is)."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat((head * cos + rotate_half(head) * sin, tail), dim=-1)


def rotary_qkv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int,
                         head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection qkv [T, (Hq + 2 Hkv) D] -> q, k rotated and v, [T, heads, D] each (the CPU path of the
    attention and the reference of kernels/rotary.py)."""
    t = qkv.shape[0]
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = apply_rotary(q.reshape(t, q_heads, head_dim), cos, sin)
    k = apply_rotary(k.reshape(t, kv_heads, head_dim), cos, sin)
    return q, k, v.reshape(t, kv_heads, head_dim)


def _llama3(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
            old_context_len: int) -> torch.Tensor:
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, base: float, factor: float, original_max: int, device: torch.device,
          beta_fast: float = 32.0, beta_slow: float = 1.0) -> tuple[torch.Tensor, float]:
    attention_scaling = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_scaling
