"""Weight offload (`offload_weights_gb`, FlexFlow Serve's CPU offload): the linear weights of some decoder layers
live in (pinned) host memory; each such layer's weights are copied into one of two device slots just ahead of use, on
a side stream, so a model larger than the GPU's free memory runs and the memory saved goes to the KV cache.

    forward start:  side waits for the main stream; copy offloaded layer 0 -> slot 0, layer 1 -> slot 1
    before layer j: main waits for layer j's copy
    after layer j:  side waits for main (slot j % 2 is free again); copy offloaded layer j + 2 -> slot j % 2

Offloaded layers are spread evenly over the depth, so the layers computed between two of them hide the next copy
when they can; at decode a layer's weights take longer to cross PCIe than to use, so offload trades speed for
memory (as in FlexFlow and DeepSpeed). Every tensor of the layer's linears moves (int4 weights as packed codes, with
their scales and zeros). CUDA graphs capture the copies and the events like any other work. On CPU the same code
runs with plain copies (host and device are both CPU memory): that is what CI tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lmd.errors import LmdError

SLOTS = 2  # device copies of offloaded layers: the one in use and the next


@dataclass(frozen=True)
class OffloadPlan:
    layers: tuple[int, ...]  # decoder layers whose linear weights live in host memory
    bytes_per_layer: int

    @property
    def bytes(self) -> int:
        """Weights kept in host memory."""
        return len(self.layers) * self.bytes_per_layer

    @property
    def saved_bytes(self) -> int:
        """Device memory freed: the hosted weights less the slots they are copied into."""
        return max(0, len(self.layers) - SLOTS) * self.bytes_per_layer


def plan_offload(gb: float, num_layers: int, bytes_per_layer: int) -> OffloadPlan:
    """Enough layers to free at least `gb` GiB of this device (the two slots the offloaded layers share count against
    it, so that is two layers more; every layer at most), spread evenly."""
    if gb <= 0:
        return OffloadPlan((), bytes_per_layer)
    count = min(num_layers, math.ceil(gb * 2**30 / bytes_per_layer) + SLOTS)
    layers = tuple(sorted({(2 * i + 1) * num_layers // (2 * count) for i in range(count)}))
    return OffloadPlan(layers, bytes_per_layer)


def layer_linear_tensors(layer: Any) -> list[tuple[Any, str, torch.Tensor]]:
    """(linear, attribute, tensor) of every tensor of a decoder layer's linears, in a fixed order."""
    out = []
    for linear in (layer.attention.w_qkv, layer.attention.wo, layer.mlp.w13, layer.mlp.w2):
        out += [(linear, name, value) for name, value in vars(linear).items() if isinstance(value, torch.Tensor)]
    return out


def linear_weight_names(layer: int) -> tuple[str, ...]:
    """Prefixes of a layer's linear tensors in a workspace's weights (what `plan` moves off the device)."""
    p = f"layers.{layer}."
    return tuple(p + name for name in ("attention.w_qkv.", "attention.wo.", "feed_forward.w13.", "feed_forward.w2."))


class LayerOffload:
    """Around each offloaded layer of the forward pass: `start()` once, then `before(i)` / `after(i)` per layer."""

    def __init__(self, layers: list[Any], plan: OffloadPlan, device: torch.device) -> None:
        self.order = list(plan.layers)
        self.position = {layer: j for j, layer in enumerate(self.order)}
        self.device = device
        self.cuda = device.type == "cuda"
        self.host: list[list[torch.Tensor]] = []
        owners = []
        for i in self.order:
            entries = layer_linear_tensors(layers[i])
            self.host.append([t.cpu().pin_memory() if self.cuda else t.cpu().clone() for _, _, t in entries])
            owners.append(entries)
        shapes = {tuple((t.shape, t.dtype) for t in tensors) for tensors in self.host}
        if len(shapes) > 1:
            raise LmdError("weight offload needs decoder layers of one shape; this model's layers differ")
        first = self.host[0] if self.host else []
        self.slots = [[torch.empty(t.shape, dtype=t.dtype, device=device) for t in first]
                      for _ in range(min(SLOTS, len(self.order)))]
        for j, entries in enumerate(owners):  # every offloaded layer reads its slot's tensors from now on
            for (linear, name, _), slot_tensor in zip(entries, self.slots[j % SLOTS], strict=True):
                setattr(linear, name, slot_tensor)
            for linear in dict.fromkeys(linear for linear, _, _ in entries):
                replan = getattr(linear, "replan", None)
                if replan is not None:  # a kernel choice made for the host tensor is made again for the slot
                    replan()
        if self.cuda:
            self.side = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event() for _ in self.order]
            self.free = [torch.cuda.Event() for _ in self.order]

    def start(self) -> None:
        if not self.order:
            return
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
        self._copy(0)
        self._copy(1)

    def before(self, layer: int) -> None:
        j = self.position.get(layer)
        if j is not None and self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[j])

    def after(self, layer: int) -> None:
        j = self.position.get(layer)
        if j is None:
            return
        if self.cuda:
            self.free[j].record(torch.cuda.current_stream(self.device))
            self.side.wait_event(self.free[j])
        self._copy(j + 2)

    def finish(self) -> None:
        """After the last layer: every side-stream operation is joined into the main stream (a CUDA-graph capture
        must end with its forked streams joined)."""
        if self.order and self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.side)

    def _copy(self, j: int) -> None:
        if j >= len(self.order):
            return
        slot = self.slots[j % SLOTS]
        if not self.cuda:
            for dst, src in zip(slot, self.host[j], strict=True):
                dst.copy_(src)
            return
        with torch.cuda.stream(self.side):
            for dst, src in zip(slot, self.host[j], strict=True):
                dst.copy_(src, non_blocking=True)
            self.ready[j].record(self.side)
