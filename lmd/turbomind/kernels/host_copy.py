"""Host values to the device, and device results to the host, without waiting for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronises the stream, so every one of
them waits for the GPU to finish what was queued before. The engine builds the next step while the GPU runs the
current one (overlap), so its host-to-device copies go through pinned memory with non_blocking=True instead: the copy
is queued on the stream, and the caching host allocator keeps the pinned block alive until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float] | torch.Tensor, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A 1-d (or the given host tensor's shape) tensor of `values` on `device`, queued without a stream sync."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device=device, dtype=dtype)
    return host.to(dtype).pin_memory().to(device, non_blocking=True)


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of device tensors, queued into pinned memory (CPU tensors come back as they are). They are valid
    once the stream has passed the copies: record an event after this call and wait for it before reading."""
    if not tensors or not tensors[0].is_cuda:
        return list(tensors)
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, t in zip(out, tensors, strict=True):
        host.copy_(t, non_blocking=True)
    return out
