"""On-disk cache of the W4A16 autotuner's choices, so a second engine start on the same GPU does not tune again.

Tuning one (M bucket, N, K, group, dtype) times ~250 candidate configs (seconds each); a 7B model has four linear
shapes and a dozen buckets, minutes in all. The choice depends on the GPU, the Triton version that compiled the
candidates and lmd's own candidate list, so those are part of the key (the list as a fingerprint of its names, so
a new candidate is tuned for even where lmd's version number did not change):

    "<gpu name>|triton <version>|lmd <version>|cands <crc32>|m<bucket> n<N> k<K> g<group> <dtype>"
        ->  {"kind": ..., **fields}

The file is `$LMD_CACHE_DIR/w4a16_plans.json` (default `~/.cache/lmd`); `LMD_W4A16_PLAN_CACHE=0` turns it off. It is
rewritten whole through a temporary file and a rename, merged with what another process may have written meanwhile.
A file that cannot be read or parsed is treated as empty (it is only a cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

FILE_NAME = "w4a16_plans.json"


def enabled() -> bool:
    return os.environ.get("LMD_W4A16_PLAN_CACHE", "1") != "0"


def cache_file() -> Path:
    from lmd.cache_dir import cache_dir

    return cache_dir() / FILE_NAME


def candidates_fingerprint(names: list[str]) -> str:
    """A short tag of the candidate list that was (or would be) tuned."""
    crc = zlib.crc32("\n".join(names).encode())
    return f"{crc:08x}"


def cache_key(gpu: str, bucket: int, n: int, k: int, group: int, dtype: str, candidates: str) -> str:
    import triton

    from lmd import __version__

    return (f"{gpu}|triton {triton.__version__}|lmd {__version__}|cands {candidates}|"
            f"m{bucket} n{n} k{k} g{group} {dtype}")


def plan_to_json(plan: Any) -> dict[str, Any]:
    return {"kind": type(plan).__name__, **dataclasses.asdict(plan)}


def plan_from_json(entry: dict[str, Any], kinds: dict[str, type]) -> Any | None:
    """The plan an entry describes, or None when its kind or fields no longer exist (a cache from another version)."""
    kind = kinds.get(entry.get("kind", ""))
    if kind is None:
        return None
    fields = {f.name for f in dataclasses.fields(kind)}
    values = {name: value for name, value in entry.items() if name != "kind"}
    if set(values) != fields:
        return None
    return kind(**values)


def load(path: Path | None = None) -> dict[str, dict[str, Any]]:
    path = path or cache_file()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def store(key: str, plan: Any, path: Path | None = None) -> None:
    """Add one entry; failures to write (read-only home, full disk) are ignored: the plan is still used in memory."""
    path = path or cache_file()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = load(path)
        entries[key] = plan_to_json(plan)
        fd, tmp = tempfile.mkstemp(prefix=f".{FILE_NAME}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            raise
