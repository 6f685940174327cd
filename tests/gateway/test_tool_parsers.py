"""Tool-call parsers (``--tool-call-parser``): the calls of a finished reply in each family's
format, text when they do not parse, and while a reply streams, text up to where a call may
begin and never beyond."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.tool_parsers import HermesParser, Llama3JsonParser, ParsedReply

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_hermes_reads_each_tool_call_block_and_the_text_before_them() -> None:
    text = (
        f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
        + json.dumps({"name": "get_time", "arguments": {"zone": "CET", "utc": False}})
        + "\n</tool_call>"
    )
    assert HermesParser().parse(text) == ParsedReply(
        "Let me check.",
        [
            ("get_weather", '{"city": "Paris"}'),
            ("get_time", '{"zone": "CET", "utc": false}'),
        ],
    )


def test_hermes_takes_arguments_given_as_a_json_string_and_an_unclosed_last_block() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}'
    assert HermesParser().parse(text) == ParsedReply(None, [("f", '{"x": 1}')])


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        f"<tool_call>{WEATHER}</tool_call><tool_call>oops</tool_call>",  # one bad: all text
    ],
)
def test_hermes_output_that_is_no_call_stays_text(text: str) -> None:
    assert HermesParser().parse(text) == ParsedReply(text, [])


def test_llama3_json_reads_one_call_or_several_separated_by_semicolons() -> None:
    parser = Llama3JsonParser()
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert parser.parse(one) == ParsedReply(None, [("get_weather", '{"city": "Oslo"}')])
    two = f'<|python_tag|>{one}; {{"name": "get_time", "parameters": {{}}}}'
    assert parser.parse(two).calls == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]


@pytest.mark.parametrize(
    "text", ["The weather is fine.", '{"name": "f", "parameters": {}} and then text', "{broken"]
)
def test_llama3_json_output_that_is_no_call_stays_text(text: str) -> None:
    assert Llama3JsonParser().parse(text) == ParsedReply(text, [])


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
    parsed = parser.parse(text)
    if parsed.calls:
        held = text[sent:]
        assert isinstance(parser, Llama3JsonParser) or HermesParser.start in held
        assert parser.parse(held).calls == parsed.calls
