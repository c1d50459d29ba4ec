"""Resolution order: user path, pydoc, local mirror (with split fallback), HF hub (mocked), else one clear error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmd.calib_data import DATASETS, load_eval_text, sources
from lmd.calib_data.sources import load_rows, pydoc_rows
from lmd.errors import LmdError

MIRROR = Path(os.environ["LMD_DATA_DIR"])
needs_mirror = pytest.mark.skipif(not (MIRROR / "wikitext-2-raw" / "wiki.test.raw").is_file(),
                                  reason="no local data mirror")


@pytest.fixture
def fake_hub(monkeypatch):
    """Replace datasets.load_dataset; record calls; serve a few rows per (id, split)."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(sources, "hub_reachable", lambda: True)
    calls = []

    def load_dataset(path, name=None, split=None, data_files=None, **kwargs):
        calls.append((path, name, split, data_files))
        field = "sentence" if path == "ptb_text_only" else "text"
        return {field: [f"{path} {split} row {i}" for i in range(3)]}

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


@needs_mirror
def test_local_mirror_wikitext2_reproduces_the_hf_rows():
    rows = load_rows("wikitext2", "test", str(MIRROR))
    assert len(rows.rows) == 4358
    assert rows.rows[0] == "" and rows.rows[1] == " = Robert Boulter = \n"
    assert rows.split == "test" and "wiki.test.raw" in rows.source
    assert rows.text.startswith("\n\n = Robert Boulter = \n\n\n\n\n Robert Boulter is")


@needs_mirror
def test_ptb_eval_text_joins_stripped_sentences_with_a_space():
    text = load_eval_text("ptb", "test", str(MIRROR))
    assert text.text.startswith("no it was n't black monday but while the new york stock exchange")
    assert text.split == "test"


@needs_mirror
def test_c4_eval_uses_the_first_1100_validation_docs_and_caps_windows():
    text = load_eval_text("c4", "test", str(MIRROR))
    assert text.split == "validation" and text.max_windows == 256
    rows = load_rows("c4", "validation", str(MIRROR))
    assert len(rows.rows) == 2000
    assert text.text == " ".join(rows.rows[:1100])


@needs_mirror
@pytest.mark.parametrize(("dataset", "used"), [("wikitext2", "validation"), ("ptb", "validation")])
def test_missing_split_falls_back_and_says_so_once(capsys, dataset, used):
    rows = load_rows(dataset, "train", str(MIRROR))
    assert rows.split == used
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{dataset} has no train split in {MIRROR}; using {used} instead" in err


@needs_mirror
def test_available_split_prints_nothing(capsys):
    assert load_rows("c4", "train", str(MIRROR)).split == "train"
    assert capsys.readouterr().err == ""


def test_env_var_is_the_default_mirror(monkeypatch, tmp_path):
    (tmp_path / "ptb").mkdir()
    (tmp_path / "ptb" / "ptb.test.txt").write_text(" a b \n c d \n", encoding="utf-8")
    monkeypatch.setenv("LMD_DATA_DIR", str(tmp_path))
    rows = load_rows("ptb", "test")
    assert rows.rows == ["a b", "c d"] and rows.text == "a b c d"


def test_hub_is_used_when_the_mirror_lacks_the_dataset(tmp_path, fake_hub, capsys):
    rows = load_rows("wikitext2", "train", str(tmp_path))
    assert fake_hub == [("wikitext", "wikitext-2-raw-v1", "train", None)]
    assert rows.rows[0] == "wikitext train row 0" and rows.source.startswith("HF hub wikitext/wikitext-2-raw-v1")
    assert capsys.readouterr().err == ""


def test_hub_c4_reads_the_canonical_shards(tmp_path, fake_hub):
    load_rows("c4", "train", str(tmp_path))
    load_rows("c4", "validation", str(tmp_path))
    assert fake_hub[0] == ("allenai/c4", None, "train", {"train": "en/c4-train.00000-of-01024.json.gz"})
    assert fake_hub[1][3] == {"validation": "en/c4-validation.00000-of-00008.json.gz"}


def test_hub_split_fallback_for_pileval(tmp_path, fake_hub, capsys):
    rows = load_rows("pileval", "train", str(tmp_path))
    assert fake_hub == [("mit-han-lab/pile-val-backup", None, "validation", None)]
    assert rows.split == "validation"
    assert "pileval has no train split on the HF hub; using validation instead" in capsys.readouterr().err


def test_hub_ptb_reads_sentences(tmp_path, fake_hub):
    rows = load_rows("ptb", "test", str(tmp_path))
    assert fake_hub == [("ptb_text_only", "penn_treebank", "test", None)]
    assert rows.text == "ptb_text_only test row 0 ptb_text_only test row 1 ptb_text_only test row 2"


def test_nothing_reachable_lists_what_was_tried_and_the_fix(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(sources, "hub_reachable", lambda: True)

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'allenai/c4' on the Hub (offline)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(LmdError) as info:
        load_rows("c4", "train", str(tmp_path / "missing"))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("no data for c4 (train); tried: ")
    assert f"local mirror {tmp_path / 'missing'} (not a directory)" in message
    assert "HF hub allenai/c4 (ConnectionError: Couldn't reach" in message
    assert "--calib-dataset PATH" in message and "LMD_DATA_DIR" in message


def test_unreachable_hub_host_is_not_retried(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)

    def refuse(address, timeout):
        calls.append(("connect", address, timeout))
        raise OSError("Name or service not known")

    monkeypatch.setattr(sources.socket, "create_connection", refuse)
    sources.hub_reachable.cache_clear()
    try:
        with pytest.raises(LmdError, match=r"HF hub allenai/c4 \(host unreachable\)"):
            load_rows("c4", "train", str(tmp_path))
        assert calls == [("connect", ("huggingface.co", 443), 3)]  # one probe, no load_dataset retries
        monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # offline mode reads datasets' cache: no probe needed
        sources.hub_reachable.cache_clear()
        assert sources.hub_reachable() and len(calls) == 1
    finally:
        sources.hub_reachable.cache_clear()


def test_unset_mirror_is_reported(monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.delenv("LMD_DATA_DIR", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    with pytest.raises(LmdError, match=r"local mirror \(no --data-dir and LMD_DATA_DIR is unset\)"):
        load_rows("wikitext2", "test")


def test_unknown_dataset_lists_the_valid_names():
    with pytest.raises(LmdError, match="unknown dataset 'wikitext3'; use one of " + ", ".join(DATASETS)):
        load_rows("wikitext3", "test")


def test_missing_path_is_named(tmp_path):
    with pytest.raises(LmdError, match=r"dataset path .*nope.jsonl does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"), "test")


def test_unknown_split_is_an_error():
    with pytest.raises(LmdError, match="unknown split 'dev'"):
        load_rows("pydoc", "dev")


def test_pydoc_splits_partition_the_topics():
    from pydoc_data.topics import topics

    parts = {s: pydoc_rows(s) for s in ("train", "validation", "test")}
    assert all(parts.values())
    assert sorted(t for rows in parts.values() for t in rows) == sorted(topics.values())
    text = load_eval_text("pydoc", "valid")
    assert text.split == "validation" and text.text == "\n\n".join(parts["validation"])
    assert "pydoc_data" in text.source
