"""The loop of a torchrun rank > 0: its part of the model (tp rank RANK % tp of stage RANK // tp), one forward per
batch rank 0 broadcasts, and a heartbeat in the launcher's store so that rank 0 can name it if it dies."""

from __future__ import annotations

import threading
from typing import Any

from lmd.errors import LmdError
from lmd.turbomind.model_runner import ModelRunner
from lmd.turbomind.torchrun_env import TorchrunEnv, host_of, join_timeout_s, open_store
from lmd.turbomind.torchrun_workers import HEARTBEAT_S, broadcast


def _heartbeat(env: TorchrunEnv, stop: threading.Event) -> None:
    store = open_store(env, join_timeout_s())  # a connection of this thread's own
    while not stop.wait(HEARTBEAT_S):
        try:
            store.add(f"beat/{env.rank}", 1)
        except Exception:  # the store went with rank 0: the main loop finds the group gone too
            return


def run_torchrun_worker(env: TorchrunEnv, workspace: str, overrides: dict[str, Any]) -> None:
    """Rank `env.rank` > 0: its part of the model, one forward per driver broadcast, until the driver says stop (or
    is gone: then an LmdError naming rank 0 and its host)."""
    from lmd.turbomind.tp_group import leave_tp_group
    from lmd.turbomind.workspace import open_workspace

    tp = int(overrides.get("tp") or 1)
    ranks = {"tp_rank": env.rank % tp, "pp_rank": env.rank // tp}
    stop = threading.Event()
    runner = ModelRunner(open_workspace(workspace, **{**overrides, **ranks}))
    beat = threading.Thread(target=_heartbeat, args=(env, stop), name="lmd-heartbeat", daemon=True)
    beat.start()
    try:
        while True:
            try:
                message = broadcast(None, runner.joined.control)  # type: ignore[union-attr]
            except Exception:
                raise LmdError(f"rank {env.rank}: the driver (rank 0, {host_of(runner.joined.store, 0)}) "  # type: ignore[union-attr]
                               "stopped; this rank exits") from None
            if message is None:
                break
            runner.worker_step(*message)
    finally:
        stop.set()
        runner.close()
        leave_tp_group()
