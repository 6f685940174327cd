"""``--reasoning-parser``: a thinking model's reasoning apart from its answer in chat
replies (``reasoning_content``), whole and streamed alike however the text is cut into
responses, with an auto tool call after the thought read from the answer alone.

The formatter is fed the core's response messages directly (the tiny random model never
writes a think block); the flag's path through a real gateway is in
test_auto_tool_choice_e2e.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.text.reasoning_parsers import PARSERS
from services.gateway.text.tool_parsers import HermesParser
from tests.gateway.formatter_stream import deltas as _choices
from tests.gateway.formatter_stream import formatter, responses, stream, whole

QWEN3, R1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]


@pytest.mark.parametrize(
    ("parser", "text", "finished", "split"),
    [
        (QWEN3, "<think>\nsum it\n</think>\n\n42", True, ("\nsum it\n", "\n\n42")),
        (QWEN3, "42, no thought", True, ("", "42, no thought")),
        (QWEN3, "<think>cut by max_tokens", True, ("cut by max_tokens", "")),
        (R1, "opened by the template</think>answer", True, ("opened by the template", "answer")),
        (R1, "<think>a</think>b", True, ("a", "b")),
        (QWEN3, "<thi", False, ("", "")),  # may still be <think>
        (QWEN3, "<think>a </thi", False, ("a ", "")),  # may still be </think>
        (R1, "all thought so far", False, ("all thought so far", "")),
    ],
)
def test_reasoning_and_answer_split_at_the_think_markers(parser, text, finished, split) -> None:
    assert parser.split(text, finished) == split


def _cuts(text: str) -> st.SearchStrategy[list[str]]:
    """``text`` cut into 1..8 consecutive pieces."""
    points = st.lists(st.integers(1, len(text) - 1), max_size=7, unique=True).map(sorted)
    return points.map(lambda p: [text[a:b] for a, b in zip([0, *p], [*p, len(text)], strict=True)])


REPLY = "<think>\nThe user wants 6*7. </thi is no marker.\n</think>\n\nIt is 42."


@given(_cuts(REPLY))
def test_streamed_reasoning_and_answer_are_the_whole_replys_however_cut(parts) -> None:
    chunks = stream(formatter(reasoning=QWEN3), responses(parts))
    deltas = [c["delta"] for c in _choices(chunks)]
    (reply,) = whole(formatter(reasoning=QWEN3), responses(parts))
    thought, answer = reply["message"]["reasoning_content"], reply["message"]["content"]
    assert thought == "\nThe user wants 6*7. </thi is no marker.\n"
    assert answer == "\n\nIt is 42."
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == answer
    # Nothing of the thought leaks into the answer, nor the reverse, at any point.
    seen_answer = False
    for d in deltas:
        seen_answer |= bool(d.get("content"))
        assert not (seen_answer and d.get("reasoning_content"))


CALL = '<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>'


@given(_cuts("<think>I should call calc.</think>\n\n" + CALL))
def test_a_tool_call_after_the_thought_is_read_from_the_answer_alone(parts) -> None:
    items = responses(parts)
    attrs = {"reasoning": R1, "auto_tools": HermesParser(), "tool_names": frozenset({"calc"})}
    (reply,) = whole(formatter(**attrs), items)
    assert reply["finish_reason"] == "tool_calls"
    assert reply["message"]["reasoning_content"] == "I should call calc."
    (call,) = reply["message"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("calc", '{"expr": "6*7"}')
    chunks = stream(formatter(**attrs), items)
    deltas = [c["delta"] for c in _choices(chunks)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should call calc."
    assert "".join(d.get("content") or "" for d in deltas).strip() == ""
    (streamed,) = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert streamed["function"] == call["function"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
