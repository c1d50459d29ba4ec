"""A tensor-parallel worker process (ranks 1 .. tp-1): its rank's weights and KV cache, one forward per driver step.

The driver (rank 0, in the Engine's process) sends each step's plain-data batch down a pipe; the worker runs the same
layers on its slices, taking part in the all-reduces, eagerly or by replaying its own decode graph as the driver does,
and throws its hidden states or logits away (rank 0 computes the logits: the lm_head is replicated in every rank
file). `None` or a closed pipe ends the loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

READY = "ready"  # worker -> driver once its imports are done; then the driver sends (chunks, rows, graphed) per step
# (graphed: it replays its decode graph, and so must the worker), None to stop


class WorkerRunner(Protocol):
    def worker_step(self, chunks: list[tuple[list[int], int, list[int]]], rows: list[int], graphed: bool) -> Any: ...

    def close(self) -> None: ...


def worker_main(rank: int, tp: int, port: int, root: str, options: dict[str, Any], conn: Connection,
                make_runner: Callable[..., WorkerRunner]) -> None:
    """`make_runner(workspace, tp_port=port)` builds this rank's runner (the engine passes its ModelRunner class,
    so that this module does not import the runner that spawns it)."""
    from lmd.turbomind.tp_group import abort_tp_group, leave_tp_group
    from lmd.turbomind.workspace import open_workspace

    runner = None
    try:
        conn.send(READY)  # imports done: the driver may now wait in the group's rendezvous
        ranks = {"tp_rank": rank % tp, "pp_rank": rank // tp}  # `rank` is global: stage rank // tp
        runner = make_runner(open_workspace(root, **{**options, **ranks}), tp_port=port)
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the driver is gone: a replayed step may wait in NCCL for it, abort that first
                abort_tp_group()
                break
            if message is None:
                break
            runner.worker_step(*message)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    finally:
        if runner is not None:  # its CUDA graphs first: NCCL waits for them before it leaves
            runner.close()
        leave_tp_group()
