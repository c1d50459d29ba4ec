"""lmd: quantize a Hugging Face LLM (AWQ int4, KV int8) and serve it with a persistent-batch engine."""

from __future__ import annotations

__version__ = "0.1.0"
