"""Atomic output directory/file helpers: complete-or-nothing, no silent overwrite."""

from __future__ import annotations

import pytest

from lmd.errors import LmdError
from lmd.lite.output_dir import atomic_output_dir, atomic_output_file, check_output_dir


def test_output_dir_created_complete(tmp_path):
    target = tmp_path / "out"
    with atomic_output_dir(target, force=False) as tmp:
        (tmp / "a.txt").write_text("x")
        assert not target.exists()
    assert (target / "a.txt").read_text() == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_output_dir_failure_leaves_nothing(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_output_dir(target, force=False) as tmp:
        (tmp / "a.txt").write_text("x")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_output_dir_refuses_non_empty_without_force(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(LmdError, match="--force"):
        check_output_dir(target, force=False)
    with atomic_output_dir(target, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_output_dir_accepts_empty_existing_and_rejects_file(tmp_path):
    (tmp_path / "empty").mkdir()
    with atomic_output_dir(tmp_path / "empty", force=False) as tmp:
        (tmp / "f").write_text("1")
    assert (tmp_path / "empty" / "f").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(LmdError, match="is a file"):
        check_output_dir(tmp_path / "file", force=True)


def test_output_file_replaces_only_on_success(tmp_path):
    target = tmp_path / "x.bin"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_output_file(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError
    assert target.read_text() == "old"
    with atomic_output_file(target) as tmp:
        tmp.write_text("new")
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]
