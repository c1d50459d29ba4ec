"""ShareGPT files: where `--dataset` resolves, what a conversation yields, and one-line errors for bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmd.bench.dataset import Conversation, dataset_files, read_conversations
from lmd.errors import LmdError


def _write(path: Path, rows: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))
    return path


def _conv(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": r, "value": v} for r, v in turns]}


def test_sharegpt_resolves_through_data_dir_then_env(tmp_path, monkeypatch):
    a = _write(tmp_path / "mirror" / "sharegpt" / "b.json", [_conv(("human", "hi"))])
    b = _write(tmp_path / "mirror" / "sharegpt" / "a.jsonl", [])
    (tmp_path / "mirror" / "sharegpt" / "notes.txt").write_text("not data")
    monkeypatch.setenv("LMD_DATA_DIR", str(tmp_path / "mirror"))
    assert dataset_files("sharegpt") == [b, a]
    monkeypatch.setenv("LMD_DATA_DIR", str(tmp_path / "elsewhere"))
    assert dataset_files("sharegpt", data_dir=tmp_path / "mirror") == [b, a]  # the argument overrides the env
    with pytest.raises(LmdError, match="no ShareGPT files .*elsewhere/sharegpt"):
        dataset_files("sharegpt")
    monkeypatch.delenv("LMD_DATA_DIR")
    with pytest.raises(LmdError, match="set LMD_DATA_DIR"):
        dataset_files("sharegpt")


def test_paths_and_missing_paths(tmp_path):
    file = _write(tmp_path / "d" / "x.json", [])
    assert dataset_files(str(file)) == [file]
    assert dataset_files(str(tmp_path / "d")) == [file]
    with pytest.raises(LmdError, match="no such file or directory"):
        dataset_files(str(tmp_path / "missing.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LmdError, match="holds no .json"):
        dataset_files(str(tmp_path / "empty"))


def test_first_user_turn_reply_and_dedup(tmp_path):
    rows = [
        _conv(("human", "Q1"), ("gpt", "A1"), ("human", "Q1b")),
        _conv(("system", "be brief"), ("human", "Q2")),
        _conv(("gpt", "orphan")),
        _conv(("human", "Q1"), ("gpt", "other answer")),  # duplicate prompt: dropped
        _conv(("human", "   ")),
        {"conversations": [{"role": "user", "content": "Q3"}, {"role": "assistant", "content": "A3"}]},
    ]
    jsonl = tmp_path / "more.jsonl"
    jsonl.write_text(json.dumps(_conv(("human", "Q4"), ("human", "again"))) + "\n\n")
    got = read_conversations([_write(tmp_path / "a.json", rows), jsonl])
    assert got == [Conversation("Q1", "A1"), Conversation("Q2", None), Conversation("Q3", "A3"), Conversation("Q4", None)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"conversations": []}', "top level is a dict"),
        ('[{"id": 1}]', "no 'conversations' list"),
        ('[{"conversations": [{"from": "human"}]}]', "needs 'from' and 'value'"),
        ('[{"conversations": [{"from": "gpt", "value": "x"}]}]', "no conversation has a user turn"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(LmdError, match=message) as info:
        read_conversations([path])
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_bundled_sharegpt_sets_read(monkeypatch):
    root = Path(__file__).resolve().parents[3] / "shared" / "data"
    if not (root / "sharegpt").is_dir():
        pytest.skip("no local ShareGPT mirror")
    conversations = read_conversations(dataset_files("sharegpt", root))
    assert len(conversations) > 4000 and len({c.prompt for c in conversations}) == len(conversations)
    assert sum(c.reply is not None for c in conversations) <= 4  # first-turn-only files; a few start with gpt
