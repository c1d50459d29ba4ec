"""ShareGPT-format prompt sets: find the files, read each conversation's first user turn (and the reply, if any).

`--dataset sharegpt` means every .json/.jsonl file under `<data dir>/sharegpt/`, where the data dir is `--data-dir`
or `$LMD_DATA_DIR` (the layout of ../shared/data). Any other value is a path: one ShareGPT-format file or a
directory of them. A file holds a JSON array (or JSON lines) of `{"conversations": [{"from": ..., "value": ...}]}`;
`role`/`content` keys are accepted too. Prompts are de-duplicated by text, keeping the first occurrence.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from lmd.errors import LmdError

SHAREGPT = "sharegpt"
RANDOM = "random"  # synthetic token-id prompts; see sampling.random_requests
USER_ROLES = ("human", "user")
NOT_REPLY_ROLES = (*USER_ROLES, "system")
SUFFIXES = (".json", ".jsonl")
_LAYOUT = 'a JSON array (or JSON lines) of {"conversations": [{"from": "human", "value": "..."}, ...]}'


@dataclass(frozen=True)
class Conversation:
    prompt: str  # the first user turn
    reply: str | None  # the turn answering it, when the file has one (its length is the reference output length)


def dataset_files(dataset: str, data_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The files `--dataset` names (see the module doc); one-line errors say what is missing and the fix."""
    if dataset == SHAREGPT:
        root = data_dir if data_dir is not None else os.environ.get("LMD_DATA_DIR")
        if not root:
            raise LmdError(
                "--dataset sharegpt needs a local data directory: set LMD_DATA_DIR (or --data-dir) to a "
                "directory holding sharegpt/*.json, or pass --dataset PATH to a ShareGPT-format file"
            )
        folder = Path(root).expanduser() / SHAREGPT
        files = _files_in(folder) if folder.is_dir() else []
        if not files:
            raise LmdError(
                f"no ShareGPT files (*.json, *.jsonl) in {folder}; point --data-dir/LMD_DATA_DIR at a "
                "directory with a sharegpt/ folder, or pass --dataset PATH"
            )
        return files
    path = Path(dataset).expanduser()
    if not path.exists():
        raise LmdError(
            f"--dataset {dataset}: no such file or directory; give 'sharegpt', 'random', "
            "a ShareGPT-format .json/.jsonl file or a directory of them"
        )
    if path.is_dir():
        files = _files_in(path)
        if not files:
            raise LmdError(f"--dataset {dataset}: the directory holds no .json or .jsonl files")
        return files
    return [path]


def read_conversations(files: list[Path]) -> list[Conversation]:
    """Conversations with a non-empty first user turn, de-duplicated by prompt text, in file order."""
    seen: set[str] = set()
    out: list[Conversation] = []
    for path in files:
        for row in _rows(path):
            conversation = _first_exchange(row, path)
            if conversation is not None and conversation.prompt not in seen:
                seen.add(conversation.prompt)
                out.append(conversation)
    if not out:
        raise LmdError(f"{', '.join(str(f) for f in files)}: no conversation has a user turn; expected {_LAYOUT}")
    return out


def _files_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in SUFFIXES)


def _rows(path: Path) -> list[object]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LmdError(f"{path}: cannot read it ({exc}); give a readable UTF-8 JSON file") from None
    try:
        if path.suffix == ".jsonl":
            rows: object = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LmdError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); expected {_LAYOUT}") from None
    if not isinstance(rows, list):
        raise LmdError(f"{path}: the top level is a {type(rows).__name__}; expected {_LAYOUT}")
    return rows


def _first_exchange(row: object, path: Path) -> Conversation | None:
    turns = row.get("conversations") if isinstance(row, dict) else None
    if not isinstance(turns, list):
        raise LmdError(f"{path}: a row has no 'conversations' list ({str(row)[:60]!r}...); expected {_LAYOUT}")
    parsed = [_turn(t, path) for t in turns]
    for i, (role, text) in enumerate(parsed):
        if role in USER_ROLES:
            if not text.strip():
                return None
            after = parsed[i + 1] if i + 1 < len(parsed) else None
            reply = after[1] if after is not None and after[0] not in NOT_REPLY_ROLES and after[1].strip() else None
            return Conversation(text, reply)
    return None


def _turn(turn: object, path: Path) -> tuple[str, str]:
    if isinstance(turn, dict):
        role, text = turn.get("from", turn.get("role")), turn.get("value", turn.get("content"))
        if isinstance(role, str) and isinstance(text, str):
            return role.lower(), text
    raise LmdError(
        f"{path}: a turn is {str(turn)[:60]!r}; each turn needs 'from' and 'value' strings (or 'role' and 'content')"
    )
