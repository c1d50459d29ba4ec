"""Which implementation of an op runs: the Triton kernel or the PyTorch reference.

Each dispatch point reads its own environment variable per call: `auto` (the default) runs the kernels on CUDA
tensors, `reference` forces PyTorch, `triton` also runs the kernels on CPU tensors under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

from lmd.errors import LmdError

LAYER_OPS_ENV = "LMD_LAYER_OPS"  # residual add + RMSNorm, RoPE + KV write, SiLU * up (lmd/turbomind/kernels/)


def triton_requested(x: torch.Tensor, env: str) -> bool:
    choice = os.environ.get(env) or "auto"
    if choice not in ("auto", "reference", "triton"):
        raise LmdError(f"{env}={choice!r}: use 'auto' (the default: Triton kernels on CUDA), 'reference' or 'triton'")
    return choice == "triton" or (choice == "auto" and x.is_cuda)


@functools.cache
def triton_module(name: str) -> ModuleType | None:
    """lmd.turbomind.kernels.<name>, or None without Triton (the engine still runs, on the references)."""
    try:
        return importlib.import_module(f"lmd.turbomind.kernels.{name}")
    except ImportError:
        return None


def layer_kernel(x: torch.Tensor, name: str) -> ModuleType | None:
    """The layer-op kernel module `name` when it should run on x, else None (also for CPU tensors without
    TRITON_INTERPRET=1: no driver could launch it, so the reference runs, as for the attention)."""
    if not triton_requested(x, LAYER_OPS_ENV) or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    return triton_module(name)
