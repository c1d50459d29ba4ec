"""Per-task loading and request building, zero-shot, as lm-evaluation-harness 0.4's default task YAMLs do.

An item is a list of (context, continuation) requests, one per choice, and the index of the right one. The choice
with the highest summed log-likelihood is the answer (`acc`); `acc_norm` divides each by its choice's length in
characters (lm-eval's `len(choice)`, the choice text without the leading space). LAMBADA has one request whose
continuation must be the greedy one. Sets come from the local mirror (`eval/` under --data-dir, `$LMD_DATA_DIR` or
../shared/data) and, when it lacks one, from the hub under lm-eval's dataset names.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from lmd.errors import LmdError

DEFAULT_DATA_DIR = Path("../shared/data")


@dataclass(frozen=True)
class Item:
    requests: tuple[tuple[str, str], ...]  # (context, continuation), one per choice
    gold: int
    choice_lengths: tuple[int, ...] | None = None  # acc_norm divisors; None: the task reports acc only


@dataclass(frozen=True)
class TaskSet:
    task: str
    items: list[Item]
    source: str
    greedy: bool = False  # LAMBADA: acc = the continuation is the greedy one


def _choices(context: str, choices: list[str], gold: int, norm: bool = True) -> Item:
    return Item(tuple((context, " " + c) for c in choices), gold, tuple(len(c) for c in choices) if norm else None)


def arc_item(doc: dict) -> Item:
    """lm-eval arc_easy / arc_challenge over the original ARC schema ({question: {stem, choices}, answerKey})."""
    q = doc["question"]
    texts, labels = [c["text"] for c in q["choices"]], [c["label"] for c in q["choices"]]
    return _choices(f"Question: {q['stem']}\nAnswer:", texts, labels.index(doc["answerKey"]))


def piqa_item(doc: dict) -> Item:
    return _choices(f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], int(doc["label"]))


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def hellaswag_item(doc: dict) -> Item:
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return _choices(_hellaswag_clean(doc["activity_label"] + ": " + ctx),
                    [_hellaswag_clean(e) for e in doc["endings"]], int(doc["label"]))


def winogrande_item(doc: dict) -> Item:
    """lm-eval's partial evaluation: each option fills the sentence up to `_`; the rest after `_` is scored."""
    return Item(tuple((ctx, " " + doc["continuation"]) for ctx in doc["context_options"]), int(doc["gold"]))


def lambada_item(text: str) -> Item:
    words = text.split(" ")
    return Item(((" ".join(words[:-1]), " " + words[-1]),), 0)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _local_piqa(root: Path) -> list[dict]:
    labels = (root / "piqa" / "valid-labels.lst").read_text().split()
    return [{**doc, "label": int(label)} for doc, label in zip(_jsonl(root / "piqa" / "valid.jsonl"), labels,
                                                               strict=True)]


def _local_lambada(root: Path) -> list[str]:
    lines = (root / "lambada" / "lambada_test_plain_text.txt").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip()]


def _hub_winogrande(rows: Iterable[dict]) -> list[dict]:
    """The hub's {sentence, option1, option2, answer} in the local partial form."""
    out = []
    for r in rows:
        i = r["sentence"].index("_")
        out.append({"context_options": [r["sentence"][:i] + r["option1"], r["sentence"][:i] + r["option2"]],
                    "continuation": r["sentence"][i + 1:].strip(), "gold": int(r["answer"]) - 1})
    return out


def _hub_arc(rows: Iterable[dict]) -> list[dict]:
    return [{"question": {"stem": r["question"], "choices": [{"text": t, "label": label} for t, label in zip(
        r["choices"]["text"], r["choices"]["label"], strict=True)]}, "answerKey": r["answerKey"]} for r in rows]


@dataclass(frozen=True)
class TaskSpec:
    local: Callable[[Path], list]  # rows from the mirror's eval/ folder
    local_file: str  # the file that must exist there
    hub: tuple[str, str | None, str]  # (dataset, config, split) under lm-eval's names
    to_item: Callable[[dict | str], Item]
    from_hub: Callable[[Iterable[dict]], list] = list
    greedy: bool = False


TASKS: dict[str, TaskSpec] = {
    "arc_easy": TaskSpec(lambda r: _jsonl(r / "arc" / "ARC-Easy-Test.jsonl"), "arc/ARC-Easy-Test.jsonl",
                         ("allenai/ai2_arc", "ARC-Easy", "test"), arc_item, _hub_arc),
    "arc_challenge": TaskSpec(lambda r: _jsonl(r / "arc" / "ARC-Challenge-Test.jsonl"),
                              "arc/ARC-Challenge-Test.jsonl", ("allenai/ai2_arc", "ARC-Challenge", "test"), arc_item,
                              _hub_arc),
    "piqa": TaskSpec(_local_piqa, "piqa/valid.jsonl", ("ybisk/piqa", None, "validation"), piqa_item),
    "hellaswag": TaskSpec(lambda r: _jsonl(r / "hellaswag" / "hellaswag_val.1000.jsonl"),
                          "hellaswag/hellaswag_val.1000.jsonl", ("Rowan/hellaswag", None, "validation"),
                          hellaswag_item),
    "winogrande": TaskSpec(lambda r: _jsonl(r / "winogrande" / "winogrande_dev.partial.jsonl"),
                           "winogrande/winogrande_dev.partial.jsonl",
                           ("allenai/winogrande", "winogrande_xl", "validation"), winogrande_item, _hub_winogrande),
    "lambada": TaskSpec(_local_lambada, "lambada/lambada_test_plain_text.txt",
                        ("EleutherAI/lambada_openai", "default", "test"), lambada_item,
                        lambda rows: [r["text"] for r in rows], greedy=True),
}


def parse_tasks(names: str) -> list[str]:
    tasks = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in tasks if n not in TASKS]
    if unknown or not tasks:
        raise LmdError(f"unknown task {', '.join(unknown) or '(none given)'}; --tasks takes a comma-separated list "
                       f"of {', '.join(TASKS)}")
    return list(dict.fromkeys(tasks))


def eval_root(data_dir: str | os.PathLike[str] | None) -> Path:
    """The mirror's eval/ folder: --data-dir, else $LMD_DATA_DIR, else ../shared/data."""
    root = data_dir if data_dir is not None else os.environ.get("LMD_DATA_DIR") or DEFAULT_DATA_DIR
    return Path(root).expanduser() / "eval"


def load_task(task: str, data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> TaskSet:
    """The first `limit` items of `task`, from the local mirror or else the hub."""
    spec = TASKS[task]
    root = eval_root(data_dir)
    if (root / spec.local_file).is_file():
        rows, source = spec.local(root), str(root / spec.local_file)
    else:
        rows, source = _from_hub(task, spec, root)
    rows = rows[:limit] if limit is not None else rows
    return TaskSet(task, [spec.to_item(row) for row in rows], source, spec.greedy)


def _from_hub(task: str, spec: TaskSpec, root: Path) -> tuple[list, str]:
    from lmd.calib_data.sources import hub_reachable

    name, config, split = spec.hub
    try:
        if not hub_reachable():  # offline, `datasets` would retry for about a minute before failing
            raise ConnectionError("host unreachable")
        from datasets import load_dataset

        rows = load_dataset(name, config, split=split)
    except Exception as exc:  # noqa: BLE001 - any hub failure becomes the same one-line error
        raise LmdError(f"{task}: {root / spec.local_file} does not exist and the hub ({name}) failed: "
                       f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; set --data-dir or "
                       "LMD_DATA_DIR to a mirror laid out like ../shared/data") from exc
    return spec.from_hub(rows), f"hub:{name}" + (f"/{config}" if config else "") + f":{split}"
