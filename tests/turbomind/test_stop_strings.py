from __future__ import annotations

from lmd.turbomind.stop_strings import StopStringMatcher


def stream(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool, list[str]]:
    emitted = []
    for delta in deltas:
        text, stopped = matcher.push(delta)
        emitted.append(text)
        if stopped:
            return "".join(emitted), True, emitted
    emitted.append(matcher.flush())
    return "".join(emitted), False, emitted


def test_stop_word_spanning_deltas_is_not_emitted():
    text, stopped, _ = stream(StopStringMatcher(["<|END|>"]), ["Hello wor", "ld<|E", "N", "D|> trailing"])
    assert (text, stopped) == ("Hello world", True)


def test_partial_prefix_is_held_then_released():
    matcher = StopStringMatcher(["###"])
    assert matcher.push("a #") == ("a ", False)
    assert matcher.push("#") == ("", False)
    assert matcher.push(" b") == ("## b", False)
    assert matcher.flush() == ""


def test_flush_returns_the_held_tail_at_the_end():
    matcher = StopStringMatcher(["User:"])
    assert matcher.push("Answer. Us") == ("Answer. ", False)
    assert matcher.flush() == "Us"
    assert matcher.flush() == ""


def test_earliest_of_several_stop_words_wins_and_stop_is_sticky():
    matcher = StopStringMatcher(["STOP", "\n\n"])
    assert matcher.push("one\n\ntwo STOP") == ("one", True)
    assert matcher.stopped
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_word_inside_a_single_delta_and_at_the_start():
    assert stream(StopStringMatcher(["ab"]), ["xxabyy"])[:2] == ("xx", True)
    assert stream(StopStringMatcher(["ab"]), ["ab"])[:2] == ("", True)


def test_overlapping_prefixes_hold_the_longest_possible_start():
    matcher = StopStringMatcher(["aab"])
    assert matcher.push("xa") == ("x", False)
    assert matcher.push("a") == ("", False)
    assert matcher.push("a") == ("a", False)  # "aaa": only the last "aa" can still start "aab"
    assert matcher.push("b") == ("", True)


def test_no_stop_words_passes_everything_through():
    matcher = StopStringMatcher([])
    assert matcher.push("anything ##") == ("anything ##", False)
    assert matcher.flush() == ""


def test_concatenation_without_a_stop_equals_the_input():
    deltas = ["The ", "sto", "ry of ", "St", "Op", " and S", "T"]
    text, stopped, _ = stream(StopStringMatcher(["STOP"]), deltas)
    assert (text, stopped) == ("".join(deltas), False)
