from __future__ import annotations

import os
import subprocess
import sys


def _lmd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmd", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_help_lists_commands_and_imports_nothing_heavy() -> None:
    code = ("import sys, lmd.cli; heavy = [m for m in ('torch', 'transformers', 'datasets', 'gradio', 'fastapi') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    result = _lmd("--help")
    assert result.returncode == 0
    assert "eval" in result.stdout


def test_unknown_command_fails_with_usage() -> None:
    result = _lmd("frobnicate")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr

