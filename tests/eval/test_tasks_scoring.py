"""The task scorer on hand-computed examples (a fake backend with fixed log-likelihoods) and lm-eval's
tokenization rule for a (context, continuation) pair."""

from __future__ import annotations

import math

import pytest

from lmd.eval.tasks.formats import Item, TaskSet, lambada_item, winogrande_item
from lmd.eval.tasks.scoring import encode_pair, mean_stderr, score_task


class FakeBackend:
    name = "fake"

    def __init__(self, answers: dict[tuple[str, str], tuple[float, bool]]) -> None:
        self.answers = answers
        self.seen: list[tuple[str, str]] = []

    def loglikelihood(self, requests, advance=lambda n: None):
        self.seen.extend(requests)
        advance(len(requests))
        return [self.answers[r] for r in requests]


def test_acc_and_acc_norm_differ_when_choice_lengths_differ():
    # choice "a" (1 char) ll -2.0 wins acc; "bbbbbbbbbb" (10 chars) ll -5.0 -> -0.5 per char wins acc_norm.
    item = Item((("Q:", " a"), ("Q:", " bbbbbbbbbb")), gold=1, choice_lengths=(1, 10))
    backend = FakeBackend({("Q:", " a"): (-2.0, False), ("Q:", " bbbbbbbbbb"): (-5.0, False)})
    result = score_task(TaskSet("arc_easy", [item], "mem"), backend)
    assert (result.acc, result.acc_norm, result.items) == (0.0, 1.0, 1)
    assert result.acc_stderr is None  # one item: no sample standard deviation


def test_two_items_means_and_stderr():
    items = [Item((("A", " x"), ("A", " yy")), 0, (1, 2)), Item((("B", " x"), ("B", " yy")), 0, (1, 2))]
    answers = {("A", " x"): (-1.0, True), ("A", " yy"): (-3.0, False),  # acc 1, norm -1 vs -1.5: 1
               ("B", " x"): (-2.0, False), ("B", " yy"): (-3.0, False)}  # acc 1, norm -2 vs -1.5: 0
    result = score_task(TaskSet("piqa", items, "mem"), FakeBackend(answers))
    assert (result.acc, result.acc_norm) == (1.0, 0.5)
    assert result.acc_stderr == 0.0 and result.acc_norm_stderr == pytest.approx(0.5)  # sqrt(0.5 / 2)


def test_winogrande_scores_the_shared_continuation_after_each_option():
    doc = {"context_options": ["The cup fell off the table because the cup", "The cup fell off the table because "
                                                                              "the table"],
           "continuation": "was tilted.", "gold": 1}
    item = winogrande_item(doc)
    assert item.requests == ((doc["context_options"][0], " was tilted."), (doc["context_options"][1], " was tilted."))
    assert item.choice_lengths is None
    backend = FakeBackend({item.requests[0]: (-7.0, False), item.requests[1]: (-4.0, False)})
    result = score_task(TaskSet("winogrande", [item], "mem"), backend)
    assert result.acc == 1.0 and result.acc_norm is None


def test_lambada_counts_greedy_continuations_and_reports_ppl():
    items = [lambada_item("the cat sat on the mat"), lambada_item("a dog ran far")]
    assert items[0].requests == (("the cat sat on the", " mat"),)
    backend = FakeBackend({items[0].requests[0]: (-0.5, True), items[1].requests[0]: (-1.5, False)})
    result = score_task(TaskSet("lambada", items, "mem", greedy=True), backend)
    assert result.acc == 0.5 and result.acc_norm is None
    assert result.ppl == pytest.approx(math.exp(1.0))


def test_mean_stderr_is_the_sample_standard_error():
    assert mean_stderr([1.0, 0.0, 0.0, 1.0]) == pytest.approx(math.sqrt((4 * 0.25) / 3 / 4))
    assert mean_stderr([1.0]) is None


class CharTokenizer:
    """One token per character (ord), so the split point is visible."""

    eos_token_id, bos_token_id = 0, None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [ord(c) for c in text]


def test_encode_pair_moves_trailing_context_whitespace_onto_the_continuation():
    ctx, cont = encode_pair(CharTokenizer(), "Answer: ", "yes")
    assert ctx == [ord(c) for c in "Answer:"] and cont == [ord(c) for c in " yes"]
    assert encode_pair(CharTokenizer(), "", "hi") == ([0], [ord("h"), ord("i")])


def test_encode_pair_takes_the_tail_of_the_joint_encoding(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ctx, cont = encode_pair(tok, "Question: Which is heavier?\nAnswer:", " a kilogram of iron")
    whole = tok.encode("Question: Which is heavier?\nAnswer: a kilogram of iron", add_special_tokens=False)
    assert ctx + cont == whole and tok.decode(cont) == " a kilogram of iron"
