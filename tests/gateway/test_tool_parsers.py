"""Tool-call parsers (``--tool-call-parser``): the calls of a finished reply in each family's
format, text when they do not parse, and while a reply streams, text up to where a call may
begin and never beyond."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.text.tool_parsers import HermesParser, Llama3JsonParser, ParsedReply
from tests.gateway.formatter_stream import deltas, formatter, responses, stream, whole

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TOOLS = frozenset({"get_weather", "get_time", "f"})  # the functions a request declares


def test_hermes_reads_each_tool_call_block_and_the_text_before_them() -> None:
    text = (
        f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
        + json.dumps({"name": "get_time", "arguments": {"zone": "CET", "utc": False}})
        + "\n</tool_call>"
    )
    assert HermesParser().parse(text, TOOLS) == ParsedReply(
        "Let me check.",
        [
            ("get_weather", '{"city": "Paris"}'),
            ("get_time", '{"zone": "CET", "utc": false}'),
        ],
    )


def test_hermes_takes_arguments_given_as_a_json_string_and_an_unclosed_last_block() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}'
    assert HermesParser().parse(text, TOOLS) == ParsedReply(None, [("f", '{"x": 1}')])


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f"}</tool_call>',  # no arguments
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not a declared tool
        "<tool_call>" + "[" * 5000,  # nested past the JSON decoder's recursion limit
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        f"<tool_call>{WEATHER}</tool_call><tool_call>oops</tool_call>",  # one bad: all text
    ],
)
def test_hermes_output_that_is_no_call_stays_text(text: str) -> None:
    assert HermesParser().parse(text, TOOLS) == ParsedReply(text, [])


def test_llama3_json_reads_one_call_or_several_separated_by_semicolons() -> None:
    parser = Llama3JsonParser()
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert parser.parse(one, TOOLS) == ParsedReply(None, [("get_weather", '{"city": "Oslo"}')])
    two = f'<|python_tag|>{one}; {{"name": "get_time", "parameters": {{}}}}'
    assert parser.parse(two, TOOLS).calls == [
        ("get_weather", '{"city": "Oslo"}'),
        ("get_time", "{}"),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "f", "parameters": {}} and then text',
        "{broken",
        '{"name": "Alice", "age": 30}',  # a JSON answer, not a call: no such tool, no arguments
        "{" * 5000,
    ],
)
def test_llama3_json_output_that_is_no_call_stays_text(text: str) -> None:
    assert Llama3JsonParser().parse(text, TOOLS) == ParsedReply(text, [])


def test_streamed_text_stops_where_a_call_may_begin() -> None:
    hermes = HermesParser()
    assert hermes.content_end("Sure, <tool") == len("Sure, ")
    assert hermes.content_end("a < b") == len("a < b")
    assert hermes.content_end("ok <tool_call>{") == len("ok ")
    llama = Llama3JsonParser()
    assert llama.content_end("  ") == 0
    assert llama.content_end('{"name"') == 0
    assert llama.content_end("<|python") == 0
    assert llama.content_end("Hello") == len("Hello")


@given(
    st.lists(st.sampled_from(["a", " ", "<", "tool", "_call", ">", WEATHER, "</tool_call>"])),
    st.sampled_from([HermesParser(), Llama3JsonParser()]),
)
def test_text_streamed_before_the_reply_ends_is_never_part_of_a_call(parts, parser) -> None:
    """Chunk by chunk, what goes out as text only grows, is the reply's own start, and ends
    before any call: the parse of the finished reply finds its calls in what was held."""
    text, sent = "", 0
    for part in parts:
        text += part
        sent = max(parser.content_end(text), sent)
        assert sent <= len(text)
    parsed = parser.parse(text, TOOLS)
    if parsed.calls:
        held = text[sent:]
        if isinstance(parser, HermesParser):
            assert held.startswith(HermesParser.start)
        else:  # a llama3_json reply that is a call is held whole
            assert sent == 0
        assert parser.parse(held, TOOLS).calls == parsed.calls


# ---- the formatter's auto tool choice, fed the core's responses ----------------------------

AUTO = {"auto_tools": HermesParser(), "tool_names": TOOLS}
REPLY = f"Checking.<tool_call>{WEATHER}</tool_call>"


def test_text_before_a_call_that_comes_in_the_final_response_is_streamed_with_it() -> None:
    """(Beam search sends a reply whole, in one final response.)"""
    items = responses([REPLY])
    (reply,) = whole(formatter(**AUTO), items)
    chunks = deltas(stream(formatter(**AUTO), items))
    (sent,) = [c["delta"] for c in chunks if c["delta"].get("tool_calls")]
    assert sent["content"] == reply["message"]["content"] == "Checking."
    assert sent["tool_calls"][0]["function"] == reply["message"]["tool_calls"][0]["function"]
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_every_token_logprob_is_streamed_though_its_text_is_held_for_a_call() -> None:
    parts = ["Hi", " <", "tool", "_call>", WEATHER, "</tool_call>", ""]
    fmt = formatter(**AUTO)
    fmt.logprobs = True
    chunks = deltas(stream(fmt, responses(parts)))
    entries = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
    assert len(entries) == len(parts)


def test_interleaved_choices_keep_their_own_text_and_calls() -> None:
    """Two choices (n = 2) streaming in turns: one answers in text, one calls."""
    text = ["The ", "answer <b>", " is 42."]
    call = ["Let me see.", "<tool_", f"call>{WEATHER}", "</tool_call>"]
    a, b = responses(text, index=0), responses(call, index=1)
    items = [x for pair in zip(a, b, strict=False) for x in pair] + b[len(a) :]
    chunks = stream(formatter(**AUTO), items)
    first, second = deltas(chunks, 0), deltas(chunks, 1)
    assert "".join(c["delta"].get("content") or "" for c in first) == "".join(text)
    assert first[-1]["finish_reason"] == "stop"
    assert "".join(c["delta"].get("content") or "" for c in second) == "Let me see."
    (calls,) = [c["delta"]["tool_calls"] for c in second if c["delta"].get("tool_calls")]
    assert calls[0]["function"]["name"] == "get_weather"
    assert second[-1]["finish_reason"] == "tool_calls"


def test_with_parallel_tool_calls_false_one_call_comes_back() -> None:
    two = f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>"
    (reply,) = whole(formatter(**AUTO, parallel_tool_calls=False), responses([two]))
    assert len(reply["message"]["tool_calls"]) == 1
