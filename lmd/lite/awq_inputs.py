"""What AWQ needs from one float decoder block's forward pass, gathered by hooks without keeping every activation.

Per input site (the input shared by q/k/v, by o, by gate/up, by down):
  - abs_sum: sum of |x| per input channel over ALL calibration tokens (-> x_mean for the scale candidates),
  - search:  a fixed random subset of token rows (the inputs on which per-token modules are re-run during the search),
  - clip:    an evenly strided subset of token rows (the inputs of the clip search),
  - gram:    only when asked (--refine-scale, --gptq): sum of x x^T over ALL calibration tokens (-> the Hessian).
Attention mixes tokens, so its search inputs are whole sequences: the call arguments of the attention module for the
first chunks, up to the token budget.

The block's outputs from this same pass (the float block, before any scaling or clipping) are the next block's inputs,
as in llm-awq and AutoAWQ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from lmd.arch import ArchSpec, get_module
from lmd.lite.layerwise import LayerInputs, run_layer


@dataclass
class InputSite:
    search_index: torch.Tensor  # sorted global token indices kept for the search
    clip_index: torch.Tensor  # sorted global token indices kept for the clip search
    abs_sum: torch.Tensor | None = None
    count: int = 0
    search: list[torch.Tensor] = field(default_factory=list)
    clip: list[torch.Tensor] = field(default_factory=list)
    keep_gram: bool = False
    gram: torch.Tensor | None = None  # sum of x x^T, float32 [in, in], when keep_gram

    def record(self, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, x.shape[-1])
        start, stop = self.count, self.count + rows.shape[0]
        part = rows.abs().to(torch.float32).sum(dim=0)
        self.abs_sum = part if self.abs_sum is None else self.abs_sum + part
        if self.keep_gram:
            rows32 = rows.to(torch.float32)
            outer = rows32.T @ rows32
            self.gram = outer if self.gram is None else self.gram + outer
        self.count = stop
        for index, store in ((self.search_index, self.search), (self.clip_index, self.clip)):
            local = index[(index >= start) & (index < stop)] - start
            if local.numel():
                store.append(rows[local.to(rows.device)].clone())

    @property
    def x_mean(self) -> torch.Tensor:
        assert self.abs_sum is not None, "no tokens recorded"
        return self.abs_sum / self.count

    @property
    def hessian(self) -> torch.Tensor:
        """mean x x^T over all calibration tokens [in, in]."""
        assert self.gram is not None, "the Gram matrix was not collected (keep_gram)"
        return self.gram / self.count

    def search_rows(self) -> torch.Tensor:
        return torch.cat(self.search, dim=0)

    def clip_rows(self) -> torch.Tensor:
        return torch.cat(self.clip, dim=0)

    def divide(self, scales: torch.Tensor) -> None:
        """The consumer's input after its producer's output channels were divided by `scales`."""
        s = scales.view(1, -1)
        self.search = [(x.to(torch.float32) / s.to(x.device)).to(x.dtype) for x in self.search]
        self.clip = [(x.to(torch.float32) / s.to(x.device)).to(x.dtype) for x in self.clip]
        if self.gram is not None:
            s = s.to(self.gram.device, torch.float32)
            self.gram = self.gram / (s.T @ s)


@dataclass
class BlockInputs:
    sites: dict[str, InputSite]  # "qkv", "o", "gate_up", "down"
    attn_calls: list[tuple[tuple, dict[str, Any]]]  # attention module (args, kwargs) of the search chunks
    outputs: LayerInputs  # the float block's outputs = the next block's inputs


SITES = ("qkv", "o", "gate_up", "down")


def _site_modules(arch: ArchSpec) -> dict[str, str]:
    """The one linear per site whose input is hooked (its siblings read the same tensor)."""
    return {"qkv": arch.q, "o": arch.o, "gate_up": arch.gate, "down": arch.down}


def sample_indices(total: int, search_tokens: int, clip_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if search_tokens <= 0 or search_tokens >= total:
        search = torch.arange(total)
    else:
        search = torch.randperm(total, generator=generator)[:search_tokens].sort().values
    step = max(1, total // clip_tokens)
    clip = torch.arange(0, total, step)[:clip_tokens]
    return search, clip


@torch.no_grad()
def collect_block_inputs(
    layer: nn.Module,
    arch: ArchSpec,
    inputs: LayerInputs,
    device: str | torch.device,
    search_tokens: int,
    clip_tokens: int,
    offload_device: str | torch.device = "cpu",
    keep_gram: bool = False,
) -> BlockInputs:
    """Run the float block over all chunks (`layer` already on `device`) and gather every site's statistics
    (with keep_gram, also each site's Gram matrix over all tokens)."""
    seqlen = inputs.hidden[0].shape[1]
    total = inputs.num_samples * seqlen
    search_index, clip_index = sample_indices(total, search_tokens, clip_tokens)
    sites = {name: InputSite(search_index, clip_index, keep_gram=keep_gram) for name in SITES}
    attn_calls: list[tuple[tuple, dict[str, Any]]] = []
    attn_budget = total if search_tokens <= 0 else search_tokens

    def site_hook(site: InputSite):
        return lambda _module, args: site.record(args[0])

    def attn_hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        taken = sum(_tokens_of(a, k) for a, k in attn_calls)
        if taken >= attn_budget:
            return
        batch, length = _hidden_of(args, kwargs).shape[:2]
        keep = min(batch, -(-(attn_budget - taken) // length))
        attn_calls.append((_take_batch(args, batch, keep), _take_batch(kwargs, batch, keep)))

    handles = [
        get_module(layer, path).register_forward_pre_hook(site_hook(sites[name]))
        for name, path in _site_modules(arch).items()
    ]
    handles.append(get_module(layer, arch.attn).register_forward_pre_hook(attn_hook, with_kwargs=True))
    try:
        outputs = run_layer(layer, inputs, device, offload_device)
    finally:
        for handle in handles:
            handle.remove()
    return BlockInputs(sites=sites, attn_calls=attn_calls, outputs=outputs)


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _tokens_of(args: tuple, kwargs: dict) -> int:
    hidden = _hidden_of(args, kwargs)
    return hidden.shape[0] * hidden.shape[1]


def _take_batch(value: Any, batch: int, keep: int) -> Any:
    """The first `keep` sequences of every tensor that carries the batch dimension (hidden, an eager mask);
    tensors shared by the batch (rotary tables, position ids of shape [1, L]) pass through."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value[:keep] if keep < batch and value.dim() > 0 and value.shape[0] == batch else value
    if isinstance(value, dict):
        return {k: _take_batch(v, batch, keep) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_take_batch(v, batch, keep) for v in value)
    return value
