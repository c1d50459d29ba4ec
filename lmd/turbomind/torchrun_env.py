"""Ranks started by torchrun (or any launcher that sets its variables): who this process is, joining the group.

`torchrun --nnodes N --node-rank r --nproc-per-node P --master-addr A --master-port M -m lmd serve WS --tp T --pp S`
starts N·P processes with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set; lmd then spawns nothing:
rank 0 drives the engine (and serves HTTP), every other rank runs its part of the model (`torchrun_workers.py`).
Joining goes through the launcher's TCPStore: each rank writes its host name there and waits, for at most
LMD_JOIN_TIMEOUT seconds, for every other rank's; a rank that never comes is named (with the node it belongs to)
instead of the group's rendezvous waiting without end.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from lmd.errors import LmdError

JOIN_TIMEOUT_ENV = "LMD_JOIN_TIMEOUT"
DEFAULT_JOIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store: every rank is a client of it

    @property
    def node(self) -> int:
        return self.rank // self.local_world


def torchrun_env() -> TorchrunEnv | None:
    """The launcher's view of this process, or None when no launcher set RANK and WORLD_SIZE (lmd spawns its ranks)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        world = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError) as exc:
        raise LmdError(f"RANK/WORLD_SIZE are set but the launcher's variables are incomplete or not numbers ({exc}); "
                       "start lmd with torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
                       "MASTER_PORT") from None
    if world <= 1:
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
    return TorchrunEnv(rank, world, local_rank, local_world, addr, port, agent)


def check_world(env: TorchrunEnv, tp: int, pp: int) -> None:
    if env.world != tp * pp:
        raise LmdError(f"torchrun started {env.world} processes but --tp {tp} x --pp {pp} needs {tp * pp}; make "
                       "--nnodes x --nproc-per-node equal tp x pp")


def join_timeout_s() -> float:
    return float(os.environ.get(JOIN_TIMEOUT_ENV, DEFAULT_JOIN_TIMEOUT_S))


def open_store(env: TorchrunEnv, timeout_s: float):  # -> torch.distributed.Store
    import torch.distributed as dist

    try:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world,
                              is_master=env.rank == 0 and not env.agent_store,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                              multi_tenant=not env.agent_store)
    except (RuntimeError, dist.DistStoreError) as exc:
        raise LmdError(f"rank {env.rank} could not reach the store at {env.master_addr}:{env.master_port} within "
                       f"{timeout_s:g} s ({exc}); check MASTER_ADDR/MASTER_PORT and that node 0 is up") from None
    return dist.PrefixStore("lmd", store)


CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class Joined:
    store: object  # lmd's keys in the launcher's store: host names, heartbeats
    control: object  # a gloo group over every rank: the driver's batches (whatever the model's backend), no timeout


def join_torchrun_group(env: TorchrunEnv, device: torch.device, tp: int, timeout_s: float) -> Joined:
    """Join the default group (every rank) with the launcher's rendezvous."""
    import torch.distributed as dist

    from lmd.turbomind.tp_group import check_no_tp_group, create_tp_groups

    check_no_tp_group()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deadline = time.monotonic() + join_timeout_s()
    store = open_store(env, join_timeout_s())
    store.set(f"host/{env.rank}", socket.gethostname())
    for rank in range(env.world):
        left = deadline - time.monotonic()
        try:
            store.wait([f"host/{rank}"], timedelta(seconds=max(left, 0.001)))
        except (RuntimeError, dist.DistStoreError):
            raise LmdError(f"rank {rank} (node {rank // env.local_world}) did not join within {join_timeout_s():g} s; "
                           f"start its torchrun, or raise {JOIN_TIMEOUT_ENV}") from None
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=env.rank, world_size=env.world,
                            timeout=timedelta(seconds=timeout_s))
    create_tp_groups(env.rank, env.world, tp)
    # A group of its own, whose waits never time out: a worker waits on it for the driver's next batch, which may come
    # after any idle time (on the model's group, timeout_s, an idle server lost its workers). A dead driver is still
    # noticed at once (its connections close).
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Joined(store, control)


def host_of(store, rank: int) -> str:
    try:
        return store.get(f"host/{rank}").decode()
    except Exception:  # the store itself may be gone with rank 0
        return "unknown host"
