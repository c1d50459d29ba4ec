"""The engine in its own process: `EngineClient` in the caller's process, `run_engine_core` in the child; the
messages between them in `messages.py`. docs/engine.md, "The engine-core process"."""

from lmd.turbomind.engine_core.client import EngineClient

__all__ = ["EngineClient"]
