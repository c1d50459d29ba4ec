"""Find the rows of a named data set or a user path.

Resolution order (first that has the data set wins):
1. `dataset` is not a known name -> a user path (file or directory, see `text_files`).
2. `pydoc` -> CPython's `pydoc_data.topics` (present on every machine; the offline fallback corpus).
3. a local mirror under `data_dir` or `$LMD_DATA_DIR` with the layout of ../shared/data. When the mirror holds the
   data set but not the asked split, the next available split is used and one line on stderr says so.
4. the Hugging Face hub via `datasets.load_dataset` with the canonical ids (imported lazily), after a 3-second check
   that the hub's host answers at all (offline, `datasets` retries for about a minute before giving up).
Nothing reachable -> one `LmdError` naming what was tried and the fix.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from lmd.calib_data.text_files import SUFFIXES, line_rows, read_rows, wikitext_rows
from lmd.errors import LmdError

DATASETS: tuple[str, ...] = ("wikitext2", "ptb", "c4", "pileval", "pydoc")
SPLITS = ("train", "validation", "test")
_SPLIT_ALIASES = {"train": "train", "validation": "validation", "valid": "validation", "val": "validation",
                  "test": "test"}
# Which split stands in for a missing one, in order of preference.
_FALLBACK = {"train": ("validation", "test"), "validation": ("test", "train"), "test": ("validation", "train")}
PYDOC_SOURCE = "pydoc_data.topics (CPython's documentation topics)"


@dataclass(frozen=True)
class Rows:
    rows: list[str]
    dataset: str
    split: str
    source: str
    joiner: str = "\n\n"

    @property
    def text(self) -> str:
        return self.joiner.join(self.rows)


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    splits: tuple[str, ...]
    hub_id: str
    joiner: str
    mirror_files: Callable[[Path, str], list[Path]]
    mirror_rows: Callable[[Path], list[str]]
    hub_rows: Callable[[str], list[str]]


def normalize_split(split: str) -> str:
    key = split.strip().lower()
    if key not in _SPLIT_ALIASES:
        raise LmdError(f"unknown split {split!r}; use train, validation (valid) or test")
    return _SPLIT_ALIASES[key]


def load_rows(dataset: str, split: str, data_dir: str | os.PathLike[str] | None = None) -> Rows:
    """The rows of `dataset` for `split` (already a name of SPLITS or an alias) following the resolution order."""
    if dataset not in DATASETS:
        return _user_path_rows(dataset)
    split = normalize_split(split)
    if dataset == "pydoc":
        return Rows(pydoc_rows(split), "pydoc", split, PYDOC_SOURCE)
    spec = SPECS[dataset]
    tried: list[str] = []
    root = data_dir if data_dir is not None else os.environ.get("LMD_DATA_DIR")
    if root:
        found = _mirror_rows(spec, Path(root).expanduser(), split, tried)
        if found is not None:
            return found
    else:
        tried.append("local mirror (no --data-dir and LMD_DATA_DIR is unset)")
    found = _hub_rows(spec, split, tried)
    if found is not None:
        return found
    raise LmdError(f"no data for {dataset} ({split}); tried: {'; '.join(tried)}. Fix: give a text file or directory "
                   "(--calib-dataset PATH / --dataset PATH), set LMD_DATA_DIR to a mirror laid out like ../shared/data, "
                   "or use the offline corpus 'pydoc'")


def say(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"lmd: {message}", style="yellow", markup=False, highlight=False, soft_wrap=True)


def _candidates(split: str, available: tuple[str, ...]) -> list[str]:
    return [s for s in (split, *_FALLBACK[split]) if s in available]


def _mirror_rows(spec: DatasetSpec, root: Path, split: str, tried: list[str]) -> Rows | None:
    if not root.is_dir():
        tried.append(f"local mirror {root} (not a directory)")
        return None
    for candidate in _candidates(split, SPLITS):
        files = spec.mirror_files(root, candidate)
        if not files:
            continue
        if candidate != split:
            say(f"{spec.name} has no {split} split in {root}; using {candidate} instead")
        rows: list[str] = []
        for file in files:
            rows.extend(spec.mirror_rows(file))
        source = ", ".join(str(f) for f in files)
        return Rows(rows, spec.name, candidate, f"local mirror {source}", spec.joiner)
    tried.append(f"local mirror {root} (no {spec.name} files)")
    return None


def _hub_rows(spec: DatasetSpec, split: str, tried: list[str]) -> Rows | None:
    candidates = _candidates(split, spec.splits)
    if not candidates:
        return None
    candidate = candidates[0]
    if not hub_reachable():
        tried.append(f"HF hub {spec.hub_id} (host unreachable)")
        return None
    try:
        rows = spec.hub_rows(candidate)
    except Exception as exc:  # noqa: BLE001 - offline, missing id, bad cache: all mean "not reachable"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        tried.append(f"HF hub {spec.hub_id} ({type(exc).__name__}: {first[:160]})")
        return None
    if candidate != split:
        say(f"{spec.name} has no {split} split on the HF hub; using {candidate} instead")
    return Rows(rows, spec.name, candidate, f"HF hub {spec.hub_id} ({candidate})", spec.joiner)


@functools.cache
def hub_reachable() -> bool:
    if any(os.environ.get(v, "") not in ("", "0") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return True  # offline mode: datasets reads its own cache and never touches the network
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        return False
    return True


def _user_path_rows(dataset: str) -> Rows:
    path = Path(dataset).expanduser()
    if path.exists():
        return Rows(read_rows(path), str(path), "all", f"file {path.resolve()}")
    if "/" in dataset or os.sep in dataset or path.suffix.lower() in SUFFIXES:
        raise LmdError(f"dataset path {dataset} does not exist; give an existing file or directory "
                       f"or one of {', '.join(DATASETS)}")
    raise LmdError(f"unknown dataset {dataset!r}; use one of {', '.join(DATASETS)} or a path to "
                   f"{', '.join(SUFFIXES)} files")


def pydoc_rows(split: str) -> list[str]:
    """Topics sorted by name, cut by size: the first 80% of the characters are train, the next 10% validation, the
    last 10% test (a topic belongs where its first character falls)."""
    from pydoc_data.topics import topics

    texts = [topics[key] for key in sorted(topics)]
    total = sum(len(t) for t in texts)
    rows, offset = [], 0
    for text in texts:
        share = offset / total
        if ("train" if share < 0.8 else "validation" if share < 0.9 else "test") == split:
            rows.append(text)
        offset += len(text)
    return rows


def _load_hub(*args: object, **kwargs: object) -> list[str]:
    import datasets

    field = kwargs.pop("field")
    return list(datasets.load_dataset(*args, **kwargs)[field])


_WIKITEXT_FILE = {"train": "train", "validation": "valid", "test": "test"}
_C4_HUB_FILES = {"train": "en/c4-train.00000-of-01024.json.gz", "validation": "en/c4-validation.00000-of-00008.json.gz"}

SPECS: dict[str, DatasetSpec] = {
    "wikitext2": DatasetSpec(
        "wikitext2", SPLITS, "wikitext/wikitext-2-raw-v1", "\n\n",
        mirror_files=lambda root, s: [p for p in [root / "wikitext-2-raw" / f"wiki.{_WIKITEXT_FILE[s]}.raw"]
                                      if p.is_file()],
        mirror_rows=lambda p: wikitext_rows(p.read_text(encoding="utf-8")),
        hub_rows=lambda s: _load_hub("wikitext", "wikitext-2-raw-v1", split=s, field="text"),
    ),
    "ptb": DatasetSpec(
        "ptb", SPLITS, "ptb_text_only", " ",
        mirror_files=lambda root, s: [p for p in [root / "ptb" / f"ptb.{_WIKITEXT_FILE[s]}.txt"] if p.is_file()],
        mirror_rows=lambda p: line_rows(p.read_text(encoding="utf-8")),
        hub_rows=lambda s: _load_hub("ptb_text_only", "penn_treebank", split=s, field="sentence"),
    ),
    "c4": DatasetSpec(
        "c4", ("train", "validation"), "allenai/c4", " ",
        mirror_files=lambda root, s: sorted((root / "c4").glob(f"c4-en-{s}*.jsonl")) if s != "test" else [],
        mirror_rows=read_rows,
        hub_rows=lambda s: _load_hub("allenai/c4", data_files={s: _C4_HUB_FILES[s]}, split=s, field="text"),
    ),
    "pileval": DatasetSpec(
        "pileval", ("validation",), "mit-han-lab/pile-val-backup", "\n\n",
        mirror_files=lambda root, s: sorted((root / "pileval").glob("*.jsonl")) if s == "validation" else [],
        mirror_rows=read_rows,
        hub_rows=lambda s: _load_hub("mit-han-lab/pile-val-backup", split=s, field="text"),
    ),
}
