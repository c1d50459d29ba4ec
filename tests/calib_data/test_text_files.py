"""Every user-path source kind reads into the rows the loaders join and sample from."""

from __future__ import annotations

import json

import pytest

from lmd.calib_data.sources import load_rows
from lmd.calib_data.text_files import read_rows
from lmd.errors import LmdError

DOCS = ["first document\nwith two lines", "second document", "third, with a comma"]


def test_txt_is_one_document_read_as_is(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("line one\n\nline two\n", encoding="utf-8")
    assert read_rows(path) == ["line one\n\nline two\n"]


def test_raw_follows_the_hf_wikitext_rows(tmp_path):
    path = tmp_path / "wiki.test.raw"
    path.write_text(" \n = Title = \n \n Body text . \n", encoding="utf-8")
    rows = read_rows(path)
    assert rows == ["", " = Title = \n", "", " Body text . \n"]
    assert load_rows(str(path), "test").text == "\n\n = Title = \n\n\n\n\n Body text . \n"


def test_jsonl_reads_the_text_field_and_skips_blank_lines(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": d, "url": "u"}) for d in DOCS) + "\n\n", encoding="utf-8")
    assert read_rows(path) == DOCS


@pytest.mark.parametrize("payload", [[{"text": d} for d in DOCS], DOCS, {"text": DOCS}])
def test_json_accepts_records_strings_or_a_text_list(tmp_path, payload):
    path = tmp_path / "docs.json"
    path.write_text(json.dumps(payload), encoding="utf-8")
    assert read_rows(path) == DOCS


def test_parquet_reads_the_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": DOCS, "id": [1, 2, 3]}), path)
    assert read_rows(path) == DOCS


def test_parquet_without_text_column_names_the_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": DOCS}), path)
    with pytest.raises(LmdError, match="no 'text' column .*body"):
        read_rows(path)


def test_directory_reads_supported_files_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("bee", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.jsonl").write_text(json.dumps({"text": "sea"}) + "\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text("ay", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    rows = load_rows(str(tmp_path), "train")
    assert rows.rows == ["ay", "bee", "sea"]
    assert rows.text == "ay\n\nbee\n\nsea"
    assert rows.split == "all" and str(tmp_path.resolve()) in rows.source


def test_empty_directory_is_an_error(tmp_path):
    with pytest.raises(LmdError, match="holds no .txt"):
        read_rows(tmp_path)


@pytest.mark.parametrize(("name", "content", "message"), [
    ("bad.jsonl", '{"text": "ok"}\n{oops\n', r"bad.jsonl:2 is not valid JSON"),
    ("notext.jsonl", '{"body": "x"}\n', r"notext.jsonl:1 has no string 'text' field"),
    ("bad.json", "[1, 2", "is not valid JSON"),
    ("obj.json", '{"a": 1}', "must hold a list"),
    ("doc.csv", "a,b\n", "unsupported type"),
])
def test_malformed_files_give_one_line_errors(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(LmdError, match=message) as info:
        read_rows(path)
    assert "\n" not in str(info.value)
