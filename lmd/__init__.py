"""lmd: quantize a Hugging Face LLM (AWQ int4, KV int8) and serve it with a persistent-batch engine."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# `import lmd` stays light (the CLI imports it): the engine, and torch with it, load on first use.
_LAZY = {"pipeline": "lmd.api", "GenerationConfig": "lmd.turbomind.gen_config"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lmd' has no attribute {name!r}")
