"""Atomic outputs: a command's results appear complete at their final path or not at all.

A directory is built in a hidden temporary sibling (same filesystem, so the final `os.replace` is a rename) and only
renamed onto the target once every file is written; a crash leaves the old target untouched. An existing non-empty
target is refused unless the user passed `--force`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lmd.errors import LmdError


def check_output_dir(target: str | os.PathLike[str], force: bool, flag: str = "--work-dir") -> Path:
    """Fail early (before any expensive work) when `target` cannot become this command's output directory."""
    path = Path(target).expanduser()
    if path.exists() and not path.is_dir():
        raise LmdError(f"{flag} {path} is a file, not a directory; give a directory path")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise LmdError(f"{flag} {path} exists and is not empty; pass --force to overwrite it or choose another path")
    parent = path.resolve().parent
    if parent.exists() and not os.access(parent, os.W_OK):
        raise LmdError(f"{flag} {path}: cannot write to {parent}; choose a writable location")
    return path


@contextmanager
def atomic_output_dir(target: str | os.PathLike[str], force: bool, flag: str = "--work-dir") -> Iterator[Path]:
    """Yield an empty temporary directory; on normal exit it replaces `target` (an existing one only with force)."""
    path = check_output_dir(target, force, flag).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the output should look like a plain mkdir
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _install(tmp, path, force, flag)


def _install(tmp: Path, path: Path, force: bool, flag: str) -> None:
    # Re-check: another process may have filled the target while we worked.
    try:
        check_output_dir(path, force, flag)
    except LmdError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old: Path | None = None
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.replace(path, old / path.name)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_output_file(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary file path next to `target`; on normal exit it is renamed onto `target`."""
    path = Path(target).resolve()
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 (and writers may recreate the file)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
