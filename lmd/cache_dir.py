"""Where lmd keeps what it may rebuild (the default model, tuned kernel plans): $LMD_CACHE_DIR, else ~/.cache/lmd."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("LMD_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "lmd")
    return Path(root).expanduser()
