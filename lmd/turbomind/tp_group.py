"""The model's process group: joining it, the collectives the model needs, leaving it.

tp * pp ranks: global rank g is tensor-parallel rank g % tp of pipeline stage g // tp. Every rank calls `join_tp_group`
with the same localhost port; gloo runs on CPU, NCCL on CUDA (rank g on cuda:g). The all-reduces of a stage run in
its tensor-parallel subgroup; the default group (every rank) agrees on the KV block count and carries the
activations between stages (`pipeline_stage.py`). One model-parallel engine per process: torch.distributed has one
default group.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
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


_tp_group = None  # this rank's stage's tensor-parallel subgroup; None: the default group (pp = 1)


def join_tp_group(rank: int, world: int, port: int, device: torch.device, tp: int | None = None) -> None:
    """`tp` < world: pipeline parallelism, world // tp stages of tp ranks each."""
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
    create_tp_groups(rank, world, world if tp is None else tp)


def create_tp_groups(rank: int, world: int, tp: int) -> None:
    """pp > 1: each stage's tensor-parallel subgroup (every rank creates every subgroup, in the same order)."""
    import torch.distributed as dist

    global _tp_group
    if tp < world:
        for stage in range(world // tp):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
            if stage == rank // tp:
                _tp_group = group


def leave_tp_group() -> None:
    import torch.distributed as dist

    global _tp_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _tp_group = None


def abort_tp_group() -> None:
    """Abort the group's communicators (NCCL): collectives stuck waiting for a dead rank return; the group is unusable
    afterwards. Best effort: a torch without the private call, or a group already gone, leaves it as it is."""
    import torch.distributed as dist

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        with contextlib.suppress(Exception):
            abort()


def await_replay(check_alive: Callable[[], None] | None) -> None:
    """Wait for a replayed step of tp > 1 without blocking in CUDA: the collectives inside a graph are not watched
    by NCCL's watchdog, so a rank that died would leave this one waiting for ever. Polling notices a dead worker
    (`check_alive` raises) and bounds the wait by LMD_TP_TIMEOUT; then the group is aborted, which ends the kernels
    stuck in it."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + timeout_s()
    while not done.query():
        try:
            if check_alive is not None:
                check_alive()
            if time.monotonic() > deadline:
                raise LmdError(f"a replayed tensor-parallel step did not finish in {timeout_s():.0f} s "
                               f"({TIMEOUT_ENV}); close this engine and open a new one")
        except LmdError:
            abort_tp_group()
            raise
        time.sleep(5e-5)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of every rank's partial output of a row-parallel linear (wo, w2), in place."""
    import torch.distributed as dist

    dist.all_reduce(x, group=_tp_group)
    return x


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest `value` over every rank (all ranks must agree on the number of KV blocks)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
