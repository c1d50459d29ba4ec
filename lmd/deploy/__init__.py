"""`lmd deploy`: HF / AWQ / GGUF model -> TurboMind-style workspace. Heavy modules load on first use."""

from __future__ import annotations

from typing import Any

__all__ = ["deploy", "run_deploy", "read_workspace_config", "load_rank_tensors"]


def __getattr__(name: str) -> Any:
    if name in ("deploy", "run_deploy"):
        from lmd.deploy import converter

        return getattr(converter, name)
    if name in ("read_workspace_config", "load_rank_tensors"):
        from lmd.deploy import workspace_reader

        return getattr(workspace_reader, name)
    raise AttributeError(f"module 'lmd.deploy' has no attribute {name!r}")
