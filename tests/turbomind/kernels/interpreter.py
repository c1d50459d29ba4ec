"""Kernel checks under Triton's CPU interpreter run as a script in a fresh process (TRITON_INTERPRET must be set
before Triton decorates any kernel): the script prints one JSON object, case name -> result, and the tests assert on
each entry. Standard library only, so the scripts can import it before torch or Triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def run_interpreted(script: Path | str, *args: str, **env: str) -> dict:
    """Run `script args` under TRITON_INTERPRET=1 (plus `env`) from the repo root; its JSON output."""
    full_env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), **env)
    proc = subprocess.run([sys.executable, str(script), *args], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def run_jobs(jobs: dict[str, Callable[[], object]], limit: int = 4) -> dict[str, object]:
    """Each job's result, or its traceback text: one failing case does not hide the others."""
    results: dict[str, object] = {}
    for name, job in jobs.items():
        try:
            results[name] = job()
        except Exception:
            results[name] = traceback.format_exc(limit=limit)
    return results
