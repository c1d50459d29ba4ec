"""The paged KV cache: one pool of blocks of `block_size` tokens shared by every sequence.

    k[layer], v[layer]   [num_blocks, block_size, Hkv, D]   compute dtype, or int8 codes (quant_policy = 4)
    k_param[layer]       [num_blocks, block_size, Hkv, 2]   fp16 (scale, zero) per token and head: online int8 only

Token t of a sequence lives at slot `block_table[t // block_size] * block_size + t % block_size`. Block ids are
handed out by the BlockManager; this module only stores and reads tensors.
"""

from __future__ import annotations

import os

import torch

from lmd.errors import LmdError
from lmd.turbomind import kv_int8
from lmd.turbomind.kernels.host_copy import to_device
from lmd.turbomind.kv_int8 import StaticKVParams

CPU_POOL_CAP_BYTES = 2 << 30  # a CPU pool is process RAM: never take more than 2 GiB for it by default


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, int8: bool = False,
                 static_params: StaticKVParams | None = None) -> None:
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.int8, self.static = int8, static_params
        storage = torch.int8 if int8 else dtype
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = [torch.empty(shape, dtype=storage, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=storage, device=device) for _ in range(num_layers)]
        online = int8 and static_params is None
        param_shape = (num_blocks, block_size, kv_heads, 2)
        self.k_param = [torch.empty(param_shape, dtype=torch.float16, device=device) for _ in range(num_layers)] \
            if online else []
        self.v_param = [torch.empty(param_shape, dtype=torch.float16, device=device) for _ in range(num_layers)] \
            if online else []

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [T, Hkv, D] of new tokens into their slots [T]."""
        k_flat, v_flat = _flat(self.k[layer]), _flat(self.v[layer])
        if not self.int8:
            k_flat.index_copy_(0, slots, k.to(self.dtype))
            v_flat.index_copy_(0, slots, v.to(self.dtype))
            return
        if self.static is not None:
            s = self.static
            k_flat.index_copy_(0, slots, kv_int8.quantize(k, s.k_scale[layer], s.k_zero[layer]))
            v_flat.index_copy_(0, slots, kv_int8.quantize(v, s.v_scale[layer], s.v_zero[layer]))
            return
        for x, codes, params in ((k, k_flat, self.k_param[layer]), (v, v_flat, self.v_param[layer])):
            scale, zero = kv_int8.online_params(x)
            codes.index_copy_(0, slots, kv_int8.quantize(x, scale[..., None], zero[..., None]))
            _flat(params).index_copy_(0, slots, torch.stack((scale, zero), dim=-1))

    def copy_blocks(self, sources: list[int], destinations: list[int]) -> None:
        """Block d gets block s's K/V (and int8 params) in every layer: forked sequences' copy-on-write."""
        device = self.k[0].device
        src, dst = to_device(sources, torch.int64, device), to_device(destinations, torch.int64, device)
        for pools in (self.k, self.v, self.k_param, self.v_param):
            for pool in pools:
                pool.index_copy_(0, dst, pool.index_select(0, src))

    def online_int8_slots(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """Codes of K and V as [slots, Hkv, D] and their params as [slots, Hkv, 2] views of an online int8 cache
        (a kernel quantizes and stores new tokens there); None otherwise."""
        if not self.int8 or self.static is not None:
            return None
        return _flat(self.k[layer]), _flat(self.v[layer]), _flat(self.k_param[layer]), _flat(self.v_param[layer])

    def float_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V of a float cache as [slots, Hkv, D] views (a kernel stores new tokens there); None for int8."""
        return None if self.int8 else (_flat(self.k[layer]), _flat(self.v[layer]))

    def read(self, layer: int, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` tokens of the sequence whose block table is `blocks`: k, v [length, Hkv, D]."""
        k = self.k[layer][blocks].flatten(0, 1)[:length]
        v = self.v[layer][blocks].flatten(0, 1)[:length]
        if not self.int8:
            return k, v
        if self.static is not None:
            s = self.static
            return (kv_int8.dequantize(k, s.k_scale[layer], s.k_zero[layer], self.dtype),
                    kv_int8.dequantize(v, s.v_scale[layer], s.v_zero[layer], self.dtype))
        kp = self.k_param[layer][blocks].flatten(0, 1)[:length]
        vp = self.v_param[layer][blocks].flatten(0, 1)[:length]
        return (kv_int8.dequantize(k, kp[..., :1], kp[..., 1:], self.dtype),
                kv_int8.dequantize(v, vp[..., :1], vp[..., 1:], self.dtype))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0] * t.shape[1], *t.shape[2:])


def block_bytes(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                int8: bool, static: bool) -> int:
    """Bytes of one block over all layers, K and V (params included for online int8)."""
    per_token_head = head_dim * (1 if int8 else dtype.itemsize) + (4 if int8 and not static else 0)
    return 2 * num_layers * block_size * kv_heads * per_token_head


def plan_num_blocks(cache_max_entry_count: float, bytes_per_block: int, device: torch.device,
                    max_useful_blocks: int) -> int:
    """> 1: a block count. <= 1: that fraction of free device memory (CPU: of available RAM, capped at 2 GiB),
    never more blocks than all slots at full session length could use."""
    if cache_max_entry_count > 1:
        return int(cache_max_entry_count)
    if device.type == "cuda":
        budget = int(_free_device_bytes(device) * cache_max_entry_count)
    else:
        budget = min(int(_available_ram() * cache_max_entry_count), CPU_POOL_CAP_BYTES)
    num_blocks = min(budget // bytes_per_block, max_useful_blocks)
    if num_blocks < 1:
        raise LmdError(f"cache_max_entry_count={cache_max_entry_count} leaves no room for one KV block "
                       f"({bytes_per_block} bytes); raise it or pass a block count (> 1)")
    return num_blocks


def _free_device_bytes(device: torch.device) -> int:
    """Free device memory, within `torch.cuda.set_per_process_memory_fraction`'s cap when one is set (the driver's
    figure ignores it, and a pool sized from that figure would not fit under the cap)."""
    index = device.index if device.index is not None else torch.cuda.current_device()  # the fraction needs one
    free, total = torch.cuda.mem_get_info(index)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _i: 1.0)(index)
    if fraction < 1.0:
        free = min(free, max(0, int(fraction * total) - torch.cuda.memory_allocated(index)))
    return free


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
