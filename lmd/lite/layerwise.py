"""Run calibration samples through a causal LM one decoder layer at a time.

Only the layer being processed sits on the compute device; the hidden states of all samples live on the offload
device (host memory) between layers, so a model larger than the device still calibrates:

    capture_layer0_inputs: embeddings (+ rotary) on device -> hidden states entering layer 0, plus the kwargs
                           the model passes to every decoder layer (position_embeddings, attention_mask, ...)
    for each layer:        with layer_on(layer, device): inputs = run_layer(layer, inputs, device)

Samples are processed in chunks of `batch_size`. Each chunk keeps its own layer kwargs because some of them (an eager
attention mask) carry the batch dimension; the last chunk may be smaller than the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmd.arch import get_arch, get_module

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from transformers import PreTrainedModel

# Per-step state the layers must not see during calibration (no KV cache is built).
_DROPPED_KWARGS = ("cache", "past_key_values", "past_key_value", "use_cache", "output_attentions")


@dataclass
class LayerInputs:
    """The inputs of one decoder layer for all calibration samples, chunk by chunk, on the offload device."""

    hidden: list[torch.Tensor]  # [chunk, L, hidden] per chunk
    layer_kwargs: list[dict[str, Any]]  # per chunk: what the model passes to each decoder layer besides hidden

    @property
    def num_samples(self) -> int:
        return sum(h.shape[0] for h in self.hidden)

    def chunks(self, device: str | torch.device) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """(hidden, kwargs) per chunk, moved to `device`."""
        for hidden, kwargs in zip(self.hidden, self.layer_kwargs, strict=True):
            yield hidden.to(device), to_device(kwargs, device)

    def cat(self) -> torch.Tensor:
        """All samples' hidden states as one tensor [n, L, hidden] on the offload device."""
        import torch

        return torch.cat(self.hidden, dim=0)


class _StopForward(Exception):
    """Raised from layer 0's pre-hook: everything after the first decoder layer's inputs is not needed."""


def to_device(value: Any, device: str | torch.device) -> Any:
    """Move tensors inside nested tuples/lists/dicts to `device`; leave everything else as is."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


def base_model(model: PreTrainedModel) -> nn.Module:
    """The module that owns the decoder layers (embeddings, rotary, final norm are its other children)."""
    layers_path = get_arch(model.config).layers
    parent = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    return get_module(model, parent) if parent else model


@contextmanager
def layer_on(module: nn.Module, device: str | torch.device) -> Iterator[nn.Module]:
    """Move `module` to `device` for the duration of the block, then back to where its parameters were."""
    home = next(module.parameters()).device
    module.to(device)
    try:
        yield module
    finally:
        module.to(home)


def capture_layer0_inputs(model: PreTrainedModel, input_ids: torch.Tensor, device: str | torch.device,
                          batch_size: int, offload_device: str | torch.device = "cpu") -> LayerInputs:
    """Run the embeddings (and rotary tables) of `model` on `device` and keep what enters decoder layer 0.

    `model` stays on its own device except the base model's non-layer children (embeddings, rotary, final norm),
    which visit `device` during the capture only. input_ids: [n, L] token ids, all samples the same length.
    """
    import torch

    base = base_model(model)
    layers = get_module(model, get_arch(model.config).layers)
    visitors = [child for child in base.children() if child is not layers]
    homes = [_device_of(child) for child in visitors]
    captured: list[tuple[torch.Tensor, dict[str, Any]]] = []

    def grab(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs = {k: v for k, v in kwargs.items() if k not in _DROPPED_KWARGS}
        captured.append((hidden.to(offload_device), to_device(kwargs, offload_device)))
        raise _StopForward

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for child in visitors:
            child.to(device)
        with torch.no_grad():
            for start in range(0, input_ids.shape[0], batch_size):
                chunk = input_ids[start:start + batch_size].to(device)
                with suppress(_StopForward):
                    base(input_ids=chunk, use_cache=False)
    finally:
        handle.remove()
        for child, home in zip(visitors, homes, strict=True):
            if home is not None:
                child.to(home)
    return LayerInputs(hidden=[h for h, _ in captured], layer_kwargs=[k for _, k in captured])


def run_layer(layer: nn.Module, inputs: LayerInputs, device: str | torch.device,
              offload_device: str | torch.device = "cpu") -> LayerInputs:
    """Run every chunk through `layer` (already placed on `device`); the outputs are the next layer's inputs."""
    import torch

    outputs: list[torch.Tensor] = []
    with torch.no_grad():
        for hidden, kwargs in inputs.chunks(device):
            out = layer(hidden, **kwargs)
            if isinstance(out, (tuple, list)):  # older transformers return (hidden, ...)
                out = out[0]
            outputs.append(out.to(offload_device))
    return LayerInputs(hidden=outputs, layer_kwargs=inputs.layer_kwargs)


def _device_of(module: nn.Module) -> torch.device | None:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return None
