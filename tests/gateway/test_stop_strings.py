"""Stop-string matching over streamed text deltas (services/gateway/text/stop_strings.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.text.stop_strings import StopStringMatcher
from tests.hypothesis_budget import examples


def feed_all(matcher: StopStringMatcher, deltas: Sequence[str]) -> tuple[list[str], str | None]:
    """Feed ``deltas`` until a match; flush if none. Returns (outputs per call, match)."""
    outs: list[str] = []
    for delta in deltas:
        out, matched = matcher.feed(delta)
        outs.append(out)
        if matched is not None:
            return outs, matched
    outs.append(matcher.flush())
    return outs, None


def test_stop_split_across_single_character_deltas_is_matched_and_trimmed():
    m = StopStringMatcher(["END"])
    assert m.feed("result: E") == ("result: ", None)
    assert m.feed("N") == ("", None)
    assert m.held_text == "EN"
    assert m.feed("D and more") == ("", "END")
    assert m.finished and m.matched == "END"


def test_stop_split_across_deltas_with_include_stop_str_returns_it():
    m = StopStringMatcher(["END"], include_stop_str_in_output=True)
    outs, matched = feed_all(m, ["result: E", "N", "D and more"])
    assert "".join(outs) == "result: END" and matched == "END"


def test_held_back_suffix_is_minimal_and_released_when_it_can_no_longer_match():
    m = StopStringMatcher(["END"])
    assert m.feed("abE") == ("ab", None)
    assert m.held_text == "E"
    assert m.feed("x") == ("Ex", None)  # "Ex" cannot start "END": released at once
    assert m.held_text == ""
    assert m.feed("hello") == ("hello", None)  # no 'E' at the end: nothing held


def test_held_back_suffix_is_the_longest_suffix_that_is_a_proper_prefix():
    m = StopStringMatcher(["abac"])
    assert m.feed("abab") == ("ab", None)  # "bab" is not a prefix, "ab" is
    assert m.held_text == "ab"
    assert m.feed("ac") == ("", "abac")  # full text "ababac": the stop starts at 2


def test_only_suffixes_that_start_a_stop_are_held_with_several_stops():
    m = StopStringMatcher(["</answer>", "\n\nUser:"])
    assert m.feed("The answer is 42.\n") == ("The answer is 42.", None)
    assert m.held_text == "\n"
    assert m.feed("\nUs") == ("", None)
    assert m.feed("ually") == ("\n\nUsually", None)
    assert m.feed(" fine</ans") == (" fine", None)
    assert m.held_text == "</ans"
    assert m.feed("wer> trailing") == ("", "</answer>")


def test_stop_string_equal_to_a_whole_delta():
    m = StopStringMatcher(["<|end|>"])
    assert m.feed("text") == ("text", None)
    assert m.feed("<|end|>") == ("", "<|end|>")


def test_stop_string_at_the_very_start_gives_empty_output():
    m = StopStringMatcher(["###"])
    assert m.feed("###rest") == ("", "###")


def test_earliest_match_in_the_text_wins_regardless_of_list_order():
    m = StopStringMatcher(["world", "hello"])
    assert m.feed("say hello world") == ("say ", "hello")


def test_two_stops_starting_at_the_same_place_prefer_the_longer():
    m = StopStringMatcher(["\n", "\n\n"], include_stop_str_in_output=True)
    assert m.feed("para\n\nnext") == ("para\n\n", "\n\n")


def test_stop_inside_a_longer_stop_in_one_delta_loses_to_the_earlier_start():
    m = StopStringMatcher(["bc", "abcd"])
    assert m.feed("xxabcdyy") == ("xx", "abcd")


def test_first_complete_stop_ends_the_text_without_waiting_for_a_longer_one():
    # "abcd" could still complete, but "bc" already has: generation stops as early as possible.
    m = StopStringMatcher(["abcd", "bc"])
    assert m.feed("xxa") == ("xx", None)
    assert m.feed("b") == ("", None)
    assert m.feed("c") == ("a", "bc")


def test_multiple_stops_each_can_end_the_text():
    for text, expected in [("one STOP two", "STOP"), ("one\n\ntwo", "\n\n"), ("x<eos>", "<eos>")]:
        m = StopStringMatcher(["STOP", "\n\n", "<eos>"])
        outs, matched = feed_all(m, list(text))
        assert matched == expected
        assert "".join(outs) == text[: text.index(expected)]


def test_unicode_stop_strings_match_across_deltas():
    cases = [
        (["🛑"], ["ok ", "🛑", " more"], "ok "),
        (["再见"], ["你好, ", "再", "见!"], "你好, "),
        (["👨‍👩‍👧"], ["family: 👨", "\u200d👩", "\u200d", "👧 done"], "family: "),
        (["café"], ["un cafe", " puis un caf", "é noir"], "un cafe puis un "),
    ]
    for stops, deltas, before in cases:
        outs, matched = feed_all(StopStringMatcher(stops), deltas)
        assert (("".join(outs)), matched) == (before, stops[0])


def test_unicode_near_misses_are_released_unchanged():
    # "cafe" + combining acute is a different code point sequence from "café".
    deltas = ["un cafe\u0301", " 👨\u200d👩", " 再 见"]
    outs, matched = feed_all(StopStringMatcher(["café", "👨\u200d👩\u200d👧", "再见"]), deltas)
    assert matched is None and "".join(outs) == "".join(deltas)


def test_no_false_positive_on_near_misses_and_case():
    deltas = ["EN", "D", " end", " E N D", " ENd", " EEND!"]
    outs, matched = feed_all(StopStringMatcher(["END?"]), deltas)
    assert matched is None
    assert "".join(outs) == "".join(deltas)


def test_flush_releases_held_text_and_finishes():
    m = StopStringMatcher(["STOP"])
    assert m.feed("almost ST") == ("almost ", None)
    assert m.flush() == "ST"
    assert m.finished and m.matched is None
    assert m.flush() == ""
    assert m.feed("STOP") == ("", None)


def test_feed_after_a_match_returns_nothing():
    m = StopStringMatcher(["x"])
    assert m.feed("ax") == ("a", "x")
    assert m.feed("more x") == ("", None)
    assert m.flush() == ""
    assert m.matched == "x"


def test_no_stop_strings_pass_everything_through():
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", None)
    assert m.flush() == ""


def test_duplicate_stops_are_deduplicated_in_order():
    assert StopStringMatcher(["a", "b", "a"]).stops == ("a", "b")


def test_invalid_stop_lists_are_refused():
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""])
    with pytest.raises(TypeError):
        StopStringMatcher("STOP")


def test_long_stop_strings_cost_linear_memory_and_little_time():
    stop = "ab" * 50_000 + "!"
    m = StopStringMatcher([stop])
    start = time.perf_counter()
    for _ in range(200):
        out, matched = m.feed("ab")
        assert matched is None
    assert out == ""  # still a prefix of the stop: everything is held
    assert m.held_text == "ab" * 200
    assert m.feed("x")[0] == "ab" * 200 + "x"
    assert time.perf_counter() - start < 1.0


# -- properties ---------------------------------------------------------------------------------

_ALPHABET = ["a", "b", "é", "😀", "\u200d"]
_stop = st.lists(st.sampled_from(_ALPHABET), min_size=1, max_size=4).map("".join)
_text = st.lists(st.sampled_from(_ALPHABET), max_size=30).map("".join)


def _chunks(text: str, sizes: list[int]) -> list[str]:
    out, i = [], 0
    for size in sizes:
        if i >= len(text):
            break
        out.append(text[i : i + size])
        i += size
    if i < len(text):
        out.append(text[i:])
    return out


def _reference(stops: list[str], deltas: list[str], include: bool) -> tuple[str, str | None]:
    """The documented semantics, by brute force over the whole text fed so far."""
    fed = ""
    for delta in deltas:
        fed += delta
        found = [(fed.find(s), -len(s), s) for s in stops if s in fed]
        if found:
            start, _, stop = min(found)
            return fed[: start + (len(stop) if include else 0)], stop
    return fed, None


def _longest_held(text: str, stops: list[str]) -> int:
    return max(
        (k for s in stops for k in range(1, len(s)) if k <= len(text) and text.endswith(s[:k])),
        default=0,
    )


@settings(max_examples=examples(300), deadline=None)
@given(
    stops=st.lists(_stop, min_size=1, max_size=4),
    text=_text,
    sizes=st.lists(st.integers(1, 6), max_size=30),
    include=st.booleans(),
)
def test_any_split_into_deltas_gives_the_documented_result_with_minimal_holdback(
    stops, text, sizes, include
):
    deltas = _chunks(text, sizes)
    m = StopStringMatcher(stops, include)
    emitted, fed, matched = "", "", None
    for delta in deltas:
        out, matched = m.feed(delta)
        emitted += out
        fed += delta
        if matched is not None:
            break
        # Everything not held is out, and what is held is exactly the minimal suffix.
        assert emitted + m.held_text == fed
        assert len(m.held_text) == _longest_held(fed, stops)
    if matched is None:
        emitted += m.flush()
    assert (emitted, matched) == _reference(stops, deltas, include)


@settings(max_examples=examples(200), deadline=None)
@given(stops=st.lists(_stop, min_size=1, max_size=4), text=_text, sizes=st.lists(st.integers(1, 6)))
def test_without_nested_stops_the_result_does_not_depend_on_the_split(stops, text, sizes):
    # When no stop string contains another, stopping at the first completion is also the
    # earliest-starting match in the whole text: the split into deltas cannot matter.
    if any(a != b and a in b for a in stops for b in stops):
        return
    one_shot = feed_all(StopStringMatcher(stops), [text])
    outs, matched = feed_all(StopStringMatcher(stops), _chunks(text, sizes))
    assert ("".join(outs), matched) == ("".join(one_shot[0]), one_shot[1])
