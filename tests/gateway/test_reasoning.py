"""``--reasoning-parser``: a thinking model's reasoning apart from its answer in chat
replies (``reasoning_content``), whole and streamed alike however the text is cut into
responses, with an auto tool call after the thought read from the answer alone.

The formatter is fed the core's response messages directly (the tiny random model never
writes a think block); the flag's path through a real gateway is in
test_auto_tool_choice_e2e.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.v1 import common_pb2
from pagedserve.v1 import generation_pb2 as G
from services.gateway.openai_format import Formatter
from services.gateway.reasoning_parsers import PARSERS
from services.gateway.tool_parsers import HermesParser

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


def _responses(parts: list[str], finish: int = common_pb2.FINISH_REASON_STOP) -> list:
    out = [G.GenerateResponse(index=0, text=p, token_ids=[1]) for p in parts]
    out[-1].finish_reason = finish
    out[-1].usage.completion_tokens = len(parts)
    return out


def _formatter(reasoning, auto_tools=None) -> Formatter:
    fmt = Formatter(SimpleNamespace(model_name="m"), "chat", False, False)  # type: ignore[arg-type]
    fmt.reasoning, fmt.auto_tools = reasoning, auto_tools
    return fmt


async def _aiter(items: list) -> Any:
    for item in items:
        yield item


def _stream(fmt: Formatter, responses: list) -> list[dict]:
    async def run() -> list[bytes]:
        return [e async for e in fmt.events(None, _aiter(responses))]

    events = asyncio.run(run())
    return [json.loads(e[len(b"data: ") :]) for e in events[:-1]]


def _whole(fmt: Formatter, responses: list) -> dict:
    return asyncio.run(fmt.collect(_aiter(responses)))["choices"][0]


def _cuts(text: str) -> st.SearchStrategy[list[str]]:
    """``text`` cut into 1..8 consecutive pieces."""
    points = st.lists(st.integers(1, len(text) - 1), max_size=7, unique=True).map(sorted)
    return points.map(lambda p: [text[a:b] for a, b in zip([0, *p], [*p, len(text)], strict=True)])


REPLY = "<think>\nThe user wants 6*7. </thi is no marker.\n</think>\n\nIt is 42."


@given(_cuts(REPLY))
def test_streamed_reasoning_and_answer_are_the_whole_replys_however_cut(parts) -> None:
    chunks = _stream(_formatter(QWEN3), _responses(parts))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    whole = _whole(_formatter(QWEN3), _responses(parts))
    assert (
        "".join(d.get("reasoning_content", "") for d in deltas)
        == (whole["message"]["reasoning_content"])
    )
    assert "".join(d.get("content") or "" for d in deltas) == whole["message"]["content"]
    assert whole["message"]["reasoning_content"] == "\nThe user wants 6*7. </thi is no marker.\n"
    assert whole["message"]["content"] == "\n\nIt is 42."
    # Nothing of the thought leaks into the answer, nor the reverse, at any point.
    seen_answer = False
    for d in deltas:
        seen_answer |= bool(d.get("content"))
        assert not (seen_answer and d.get("reasoning_content"))


CALL = '<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>'


@given(_cuts("<think>I should call calc.</think>\n\n" + CALL))
def test_a_tool_call_after_the_thought_is_read_from_the_answer_alone(parts) -> None:
    responses = _responses(parts)
    whole = _whole(_formatter(R1, HermesParser()), responses)
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["reasoning_content"] == "I should call calc."
    (call,) = whole["message"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("calc", '{"expr": "6*7"}')
    chunks = _stream(_formatter(R1, HermesParser()), responses)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should call calc."
    assert "".join(d.get("content") or "" for d in deltas).strip() == ""
    (streamed,) = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert streamed["function"] == call["function"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
