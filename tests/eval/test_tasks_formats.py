"""Request building against lm-eval 0.4's strings, written out by hand from one real item of each local set."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lmd.errors import LmdError
from lmd.eval.tasks.formats import eval_root, load_task, parse_tasks

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "eval").is_dir(), reason="no ../shared/data/eval mirror")


@needs_data
def test_arc_easy_first_item():
    item = load_task("arc_easy", DATA, limit=1).items[0]
    q = "Question: Which statement best explains why photosynthesis is the foundation of most food webs?\nAnswer:"
    assert item.requests == (
        (q, " Sunlight is the source of energy for nearly all ecosystems."),
        (q, " Most ecosystems are found on land instead of in water."),
        (q, " Carbon dioxide is more available than other gases."),
        (q, " The producers in all ecosystems are plants."))
    assert item.gold == 0 and item.choice_lengths == (59, 54, 50, 43)  # len(choice text), no leading space


@needs_data
def test_arc_challenge_first_item():
    item = load_task("arc_challenge", DATA, limit=1).items[0]
    assert item.requests[2] == ("Question: An astronomer observes that a planet rotates faster after a meteorite "
                                "impact. Which is the most likely effect of this increase in rotation?\nAnswer:",
                                " Planetary days will become shorter.")
    assert item.gold == 2 and len(item.requests) == 4


@needs_data
def test_piqa_first_item_with_its_label():
    item = load_task("piqa", DATA, limit=1).items[0]
    q = "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert item.requests[0] == (q, " Provide the guinea pig with a cage full of a few inches of bedding made of "
                                   "ripped paper strips, you will also need to supply it with a water bottle and a "
                                   "food dish.")
    assert item.requests[1][0] == q and item.gold == 0  # valid-labels.lst line 1


@needs_data
def test_hellaswag_preprocessing_of_a_wikihow_item():
    items = load_task("hellaswag", DATA, limit=4).items
    assert items[0].requests[3] == ("Pole vault: Pole vault is a sport where you run with a pole and stop and swing "
                                    "your body. A few women", " are in the gym practicing to do this pole vault, "
                                                              "trying to do their best.")
    item = items[3]  # ctx_b empty, [header]/[title]/[step] markers
    assert item.requests[0][0] == (
        "Sports and Fitness: How to bowl the leg spinner's variations. To bowl a googly, you grip the ball the same "
        "as you would for a leg break but hold it so your palm faces away from you. As you bowl, you bring your "
        "elbow close to your head and cock your wrist so that back of your hand faces the batsman. You spin the ball "
        "by rotating the fingers.")
    assert item.requests[0][1] == ("  If you're outside, the batsman only looks at the batsman as they dribble.. "
                                   "If you're inside, the batsman lets you line up the batsman with you.")
    assert item.gold == 2


@needs_data
def test_winogrande_first_item():
    item = load_task("winogrande", DATA, limit=1).items[0]
    assert item.requests == (("Sarah was a much better surgeon than Maria so Sarah", " always got the easier cases."),
                             ("Sarah was a much better surgeon than Maria so Maria", " always got the easier cases."))
    assert item.gold == 1 and item.choice_lengths is None


@needs_data
def test_lambada_first_item():
    task = load_task("lambada", DATA, limit=1)
    (context, target), = task.items[0].requests
    assert target == " signs" and task.greedy
    assert context.startswith("in my palm is a clear stone") and context.endswith("i do n't care about")


def test_unknown_task_names_the_valid_ones():
    with pytest.raises(LmdError, match="unknown task mmlu; --tasks takes .*arc_easy, arc_challenge, piqa"):
        parse_tasks("arc_easy,mmlu")
    assert parse_tasks("piqa, piqa,arc_easy") == ["piqa", "arc_easy"]


def test_data_dir_defaults(monkeypatch):
    monkeypatch.setenv("LMD_DATA_DIR", "/x/mirror")
    assert eval_root(None) == Path("/x/mirror/eval") and eval_root("/y") == Path("/y/eval")
    monkeypatch.delenv("LMD_DATA_DIR")
    assert eval_root(None) == Path("../shared/data/eval")


def test_missing_file_and_no_hub_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LmdError, match=r"piqa: .*piqa/valid.jsonl does not exist and the hub \(ybisk/piqa\) failed"
                                       r".*set --data-dir or LMD_DATA_DIR") as info:
        load_task("piqa", tmp_path)
    assert "\n" not in str(info.value)


def test_unreachable_hub_fails_at_once_without_datasets(tmp_path, monkeypatch):
    import lmd.calib_data.sources as sources

    monkeypatch.setattr(sources, "hub_reachable", lambda: False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # importing it would raise: the check must come first
    with pytest.raises(LmdError, match=r"arc_easy: .*ARC-Easy-Test.jsonl does not exist and the hub "
                                       r"\(allenai/ai2_arc\) failed: host unreachable; set --data-dir"):
        load_task("arc_easy", tmp_path)
