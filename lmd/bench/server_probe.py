"""Before `lmd bench serve` tokenizes anything: the URL answers, the key is accepted, the model is served."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmd.errors import LmdError


@dataclass(frozen=True)
class ServedModel:
    id: str
    owned_by: str | None  # "lmd", "vllm", "sglang", ...: the default label of the run
    max_model_len: int | None  # prompt + output tokens a request may hold, when the server says (vLLM, lmd)


def base_url(url: str) -> str:
    """scheme://host:port[/prefix] from what a user may paste: a trailing / or /v1 is dropped."""
    if not url.startswith(("http://", "https://")):
        raise LmdError(f"URL {url!r} must start with http:// or https:// (e.g. http://127.0.0.1:23333)")
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def served_model(base: str, model: str | None, headers: dict[str, str], timeout_s: float) -> ServedModel:
    """GET /v1/models: `model`'s entry, or the first model when `model` is None."""
    import httpx

    fix = "start the server (e.g. `lmd serve WORKSPACE --port 23333`) or fix the URL"
    try:
        response = httpx.get(f"{base}/v1/models", headers=headers, timeout=min(timeout_s, 30.0))
    except httpx.HTTPError as exc:
        raise LmdError(f"cannot reach {base} ({type(exc).__name__}: {exc}); {fix}") from None
    if response.status_code in (401, 403):
        raise LmdError(f"{base} refused the request (HTTP {response.status_code}); pass --api-key or set OPENAI_API_KEY")
    try:
        entries = response.json()["data"] if response.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        entries = None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "id" in e for e in entries):
        raise LmdError(
            f"{base}/v1/models answered HTTP {response.status_code} without a model list; "
            "give the URL of an OpenAI-compatible server"
        )
    if not entries:
        raise LmdError(f"{base} serves no model (its /v1/models is empty)")
    ids = [str(e["id"]) for e in entries]
    if model is not None and model not in ids:
        raise LmdError(f"--model {model} is not served by {base}; it serves {', '.join(ids)}")
    entry: dict[str, Any] = entries[ids.index(model) if model is not None else 0]
    length = entry.get("max_model_len")
    return ServedModel(str(entry["id"]), entry.get("owned_by"), length if isinstance(length, int) else None)
