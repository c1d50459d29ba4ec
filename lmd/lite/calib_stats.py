"""Observers that `lmd calibrate` hooks into a decoder layer, and the LMDeploy-layout dicts they export.

Per channel (last dim) of every linear's input and every linear/norm's output: max, min, absmax, mean, absmean over
all calibration tokens. Per decoder layer, keys after RoPE and values exactly as the KV cache would hold them: max,
min, absmax per (kv head, head dim).

Means are exact token means (float64 running sums / token count), so they do not depend on how samples are batched
(LMDeploy averages per-batch means instead). Everything is exported as float32 on the CPU.

Keys are rebuilt from k_proj's output (k_norm's where the architecture normalises each key head: Qwen3) with the
`apply_rotary_pos_emb` of the layer's own modeling module and the `position_embeddings` (cos, sin) the layer
receives, i.e. the same ops the attention forward runs before the cache update; tests compare them with the
`past_key_values` of a full HF forward.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmd.arch import ArchSpec, get_module
from lmd.errors import LmdError

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

CHANNEL_STATS = ("max", "min", "mean", "absmax", "absmean")
HEAD_STATS = ("max", "min", "absmax")


class ChannelSummaries:
    """Per-chunk reductions (max, min, sum, abs sum over rows) of a tensor [..., dim], computed once per tensor.

    A norm's output is also the input of q/k/v (or gate/up), so several observers see the same tensor object; the
    cache keeps the last few tensors alive and matches by identity, so a freed tensor's address is never reused.
    Sums run as a [1, rows] x [rows, dim] GEMM: on CPU a column reduction (or a transposed GEMV) is several times slower.
    """

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: list[tuple[torch.Tensor, int, tuple]] = []

    def get(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        for tensor, version, summary in self._entries:
            if tensor is x and version == x._version:  # _version moves on any in-place write
                return summary
        summary = self._compute(x)
        self._entries = [(x, x._version, summary), *self._entries[: self.size - 1]]
        return summary

    def clear(self) -> None:
        self._entries.clear()

    @staticmethod
    def _compute(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        import torch

        flat = x.detach().reshape(-1, x.shape[-1])
        if flat.dtype != torch.float32:
            flat = flat.float()
        ones = torch.ones(1, flat.shape[0], dtype=flat.dtype, device=flat.device)  # [1, rows] @ flat: a GEMM
        return (flat.amax(0), flat.amin(0), (ones @ flat)[0].double(), (ones @ flat.abs())[0].double(),
                flat.shape[0])


class ChannelObserver:
    """Running per-channel statistics of tensors [..., dim]."""

    def __init__(self, dim: int, summaries: ChannelSummaries | None = None) -> None:
        self.dim = dim
        self.count = 0
        self.summaries = summaries
        self._max: torch.Tensor | None = None
        self._min: torch.Tensor | None = None
        self._sum: torch.Tensor | None = None
        self._abssum: torch.Tensor | None = None

    def observe(self, x: torch.Tensor) -> None:
        import torch

        if x.shape[-1] != self.dim:
            raise ValueError(f"observer expects last dim {self.dim}, got shape {tuple(x.shape)}")
        summary = self.summaries.get(x) if self.summaries is not None else ChannelSummaries._compute(x)
        cur_max, cur_min, cur_sum, cur_abssum, rows = summary
        if self._max is None:
            self._max, self._min, self._sum, self._abssum = cur_max, cur_min, cur_sum, cur_abssum
        else:
            self._max = torch.maximum(self._max, cur_max)
            self._min = torch.minimum(self._min, cur_min)
            self._sum = self._sum + cur_sum
            self._abssum = self._abssum + cur_abssum
        self.count += rows

    def result(self) -> dict[str, torch.Tensor]:
        import torch

        if self._max is None:
            raise RuntimeError("observer saw no data")
        return {"max": self._max.cpu(), "min": self._min.cpu(),
                "absmax": torch.maximum(self._max.abs(), self._min.abs()).cpu(),
                "mean": (self._sum / self.count).float().cpu(), "absmean": (self._abssum / self.count).float().cpu()}


class HeadObserver:
    """Running max/min/absmax per (head, head dim) of tensors [batch, heads, seq, head_dim]."""

    def __init__(self, num_heads: int, head_dim: int) -> None:
        self.shape = (num_heads, head_dim)
        self._max: torch.Tensor | None = None
        self._min: torch.Tensor | None = None

    def observe(self, x: torch.Tensor) -> None:
        import torch

        if x.dim() != 4 or (x.shape[1], x.shape[3]) != self.shape:
            raise ValueError(f"observer expects [batch, {self.shape[0]}, seq, {self.shape[1]}], got {tuple(x.shape)}")
        cur_max = x.detach().amax(dim=(0, 2)).float()
        cur_min = x.detach().amin(dim=(0, 2)).float()
        if self._max is None:
            self._max, self._min = cur_max, cur_min
        else:
            self._max = torch.maximum(self._max, cur_max)
            self._min = torch.minimum(self._min, cur_min)

    def result(self) -> dict[str, torch.Tensor]:
        import torch

        if self._max is None:
            raise RuntimeError("observer saw no data")
        return {"max": self._max.cpu(), "min": self._min.cpu(),
                "absmax": torch.maximum(self._max.abs(), self._min.abs()).cpu()}


@dataclass
class CalibStats:
    """All observers of one calibration run, keyed by module full name (e.g. `model.layers.0.self_attn.q_proj`)."""

    inputs: dict[str, ChannelObserver] = field(default_factory=dict)
    outputs: dict[str, ChannelObserver] = field(default_factory=dict)
    keys: dict[str, HeadObserver] = field(default_factory=dict)
    values: dict[str, HeadObserver] = field(default_factory=dict)

    def export(self) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
        """LMDeploy's layout: file stem -> stat name -> module full name -> tensor (decoder layer name for KV)."""
        return {
            "inputs_stats": _by_stat(self.inputs, CHANNEL_STATS),
            "outputs_stats": _by_stat(self.outputs, CHANNEL_STATS),
            "key_stats": _by_stat(self.keys, HEAD_STATS),
            "value_stats": _by_stat(self.values, HEAD_STATS),
        }


def _by_stat(observers: dict[str, Any], stats: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    results = {name: obs.result() for name, obs in observers.items()}
    return {stat: {name: res[stat] for name, res in results.items()} for stat in stats}


class LayerHooks:
    """Context manager: while active, every forward of decoder layer `layer` feeds the observers in `stats`."""

    def __init__(self, stats: CalibStats, layer: nn.Module, layer_name: str, arch: ArchSpec,
                 num_kv_heads: int, head_dim: int) -> None:
        self.stats, self.layer, self.layer_name, self.arch = stats, layer, layer_name, arch
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self._handles: list[Any] = []
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._summaries = ChannelSummaries()

    def __enter__(self) -> LayerHooks:
        import torch.nn as nn

        for rel in self.arch.linears:
            linear = get_module(self.layer, rel)
            if not isinstance(linear, nn.Linear):
                raise LmdError(f"{self.layer_name}.{rel} is {type(linear).__name__}, not nn.Linear; "
                               "calibrate a float (non-quantized) model")
            self._watch_input(linear, f"{self.layer_name}.{rel}")
            self._watch_output(linear, f"{self.layer_name}.{rel}")
        for rel in (self.arch.attn_norm, self.arch.mlp_norm):
            self._watch_output(get_module(self.layer, rel), f"{self.layer_name}.{rel}")
        self._watch_kv()
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._rope = None
        self._summaries.clear()

    def _watch_input(self, module: nn.Module, name: str) -> None:
        obs = self.stats.inputs.setdefault(name, ChannelObserver(module.in_features))
        obs.summaries = self._summaries
        self._handles.append(module.register_forward_pre_hook(lambda _m, args: obs.observe(args[0])))

    def _watch_output(self, module: nn.Module, name: str) -> None:
        obs = self.stats.outputs.setdefault(name, ChannelObserver(module.weight.shape[0]))
        obs.summaries = self._summaries
        self._handles.append(module.register_forward_hook(lambda _m, _args, out: obs.observe(out)))

    def _watch_kv(self) -> None:
        attn = get_module(self.layer, self.arch.attn)
        apply_rope = rotary_function(attn)
        shape = (self.num_kv_heads, self.head_dim)
        k_obs = self.stats.keys.setdefault(self.layer_name, HeadObserver(*shape))
        v_obs = self.stats.values.setdefault(self.layer_name, HeadObserver(*shape))

        def grab_rope(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            rope = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            if rope is None:
                raise LmdError(f"{self.layer_name}: the attention received no position_embeddings; this transformers "
                               "version computes RoPE differently from the one lmd supports (>= 4.56)")
            self._rope = rope

        def on_keys(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
            if self._rope is None:
                raise RuntimeError(f"{self.layer_name}: k_proj ran outside its attention forward")
            cos, sin = self._rope
            keys = out.transpose(1, 2) if self.arch.qk_norm else self._heads(out)  # k_norm gives [b, s, heads, d]
            _, rotated = apply_rope(keys, keys, cos, sin)
            k_obs.observe(rotated)

        def on_values(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
            v_obs.observe(self._heads(out))

        self._handles.append(attn.register_forward_pre_hook(grab_rope, with_kwargs=True))
        keys_from = self.arch.k_norm if self.arch.qk_norm else self.arch.k  # the keys RoPE rotates
        self._handles.append(get_module(self.layer, keys_from).register_forward_hook(on_keys))
        self._handles.append(get_module(self.layer, self.arch.v).register_forward_hook(on_values))

    def _heads(self, projected: torch.Tensor) -> torch.Tensor:
        """[batch, seq, kv_heads * head_dim] -> [batch, kv_heads, seq, head_dim], the cache layout."""
        return projected.view(*projected.shape[:-1], self.num_kv_heads, self.head_dim).transpose(1, 2)


def rotary_function(attn: nn.Module) -> Any:
    """The `apply_rotary_pos_emb(q, k, cos, sin)` the attention module's own forward uses."""
    module = sys.modules.get(type(attn).__module__)
    fn = getattr(module, "apply_rotary_pos_emb", None)
    if fn is None:
        raise LmdError(f"{type(attn).__name__} has no apply_rotary_pos_emb in its modeling module; "
                       "cannot rebuild post-RoPE keys for this architecture")
    return fn


def observe_final_norm(stats: CalibStats, norm: nn.Module, name: str, hidden: list[torch.Tensor],
                       device: str | torch.device) -> None:
    """The final norm's output statistics (LMDeploy records every norm), from the last layer's outputs."""
    import torch

    obs = stats.outputs.setdefault(name, ChannelObserver(norm.weight.shape[0]))
    with torch.no_grad():
        for chunk in hidden:
            obs.observe(norm(chunk.to(device)))
