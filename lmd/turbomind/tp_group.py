"""The tensor-parallel process group: joining it, the two collectives the model needs, leaving it.

Every rank calls `join_tp_group` with the same localhost port; gloo runs on CPU, NCCL on CUDA (rank r on cuda:r).
One tensor-parallel engine per process: torch.distributed has one default group.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch

from lmd.errors import LmdError

TIMEOUT_ENV = "LMD_TP_TIMEOUT"  # seconds a collective may wait for the other ranks (a long prefill included)
DEFAULT_TIMEOUT_S = 600


def free_port() -> int:
    """A TCP port free on localhost now (the OS picks it), for the group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def check_no_tp_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        raise LmdError("this process already runs a tensor-parallel engine; close it before opening another with tp > 1")


def join_tp_group(rank: int, world: int, port: int, device: torch.device) -> None:
    import torch.distributed as dist

    check_no_tp_group()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s()),
    )


def leave_tp_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of every rank's partial output of a row-parallel linear (wo, w2), in place."""
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest `value` over the ranks (all ranks must agree on the number of KV blocks)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
