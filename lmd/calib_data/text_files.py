"""Read user-given text files into rows (documents): `.txt`, `.raw`, `.jsonl`, `.json`, `.parquet`, or a directory.

Row conventions (they decide what "joined text" means downstream):
- `.txt`: the whole file is one document, read as is.
- `.raw`: the wikitext-2-raw layout, read the way the HF `wikitext` rows are: one row per line with its `\\n` kept and
  every blank ` \\n` line turned into an empty row, so joining with "\\n\\n" reproduces GPTQ/AWQ figures offline.
- `.jsonl` / `.json` / `.parquet`: one row per record's `text` field (`.json` may also be a list of strings).
- a directory: every supported file below it, in sorted path order.
"""

from __future__ import annotations

import json
from pathlib import Path

from lmd.errors import LmdError

SUFFIXES = (".txt", ".raw", ".jsonl", ".json", ".parquet")


def read_rows(path: Path) -> list[str]:
    """Rows of a supported file or of every supported file under a directory."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
        if not files:
            raise LmdError(f"dataset directory {path} holds no {', '.join(SUFFIXES)} files; add some or give a file")
        rows: list[str] = []
        for file in files:
            rows.extend(read_file_rows(file))
        return rows
    return read_file_rows(path)


def read_file_rows(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise LmdError(f"dataset file {path} has an unsupported type; use one of {', '.join(SUFFIXES)} or a directory")
    try:
        if suffix == ".parquet":
            return _parquet_rows(path)
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LmdError(f"cannot read dataset file {path}: {exc}; give a readable UTF-8 file") from exc
    if suffix == ".txt":
        return [text]
    if suffix == ".raw":
        return wikitext_rows(text)
    if suffix == ".jsonl":
        return _jsonl_rows(path, text)
    return _json_rows(path, text)


def wikitext_rows(text: str) -> list[str]:
    return ["" if line == " \n" else line for line in text.splitlines(keepends=True)]


def line_rows(text: str) -> list[str]:
    """One stripped row per line (the HF `ptb_text_only` convention)."""
    return [line.strip() for line in text.splitlines()]


def _jsonl_rows(path: Path, text: str) -> list[str]:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LmdError(f"{path}:{number} is not valid JSON ({exc.msg}); fix the line or remove it") from exc
        rows.append(_text_field(record, f"{path}:{number}"))
    return rows


def _json_rows(path: Path, text: str) -> list[str]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LmdError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); fix it") from exc
    if isinstance(data, dict) and isinstance(data.get("text"), list):
        data = data["text"]
    if not isinstance(data, list):
        raise LmdError(f"{path} must hold a list of records with a 'text' field (or a list of strings)")
    return [item if isinstance(item, str) else _text_field(item, f"{path}[{i}]") for i, item in enumerate(data)]


def _text_field(record: object, where: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise LmdError(f"{where} has no string 'text' field; every record needs one")
    return record["text"]


def _parquet_rows(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        if "text" not in schema.names:
            raise LmdError(f"{path} has no 'text' column (columns: {', '.join(schema.names)}); add one")
        column = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    except LmdError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several unrelated types for a bad file
        raise LmdError(f"cannot read parquet file {path}: {exc}; give a valid parquet file") from exc
    return [value for value in column if isinstance(value, str)]
