"""Anthropic's Messages API (``POST /v1/messages``) of a real gateway process, driven by the
official ``anthropic`` SDK (and ``httpx`` for the raw events): greedy text equal to the chat
completions route for the same conversation, streamed or not; stop sequences; tool use with
``tool_choice`` any / tool / auto and a tool-result turn; usage with the prefix cache's
reads; token counting; the API key as ``x-api-key``; errors in Anthropic's shape naming the
field; no block left in use."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from pagedserve.testing.procs import ServiceProcess, gateway_args, wait_serving
from tests.gateway.conftest import Stack
from tests.gateway.test_auto_tool_choice_e2e import CALL
from tests.gateway.test_structured_outputs_e2e import TIME, WEATHER

KEY = "sk-test-messages"
SYSTEM = "Be brief."
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "ignore_eos": True}  # (the 2.x SDK takes sampling in the body)


def _anthropic_tool(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    out = {"name": fn["name"], "input_schema": fn["parameters"]}
    return {**out, "description": fn["description"]} if "description" in fn else out


TOOLS = [_anthropic_tool(WEATHER), _anthropic_tool(TIME)]


@pytest.fixture(scope="module")
def port(stack: Stack) -> Iterator[int]:
    """A gateway with an API key and the hermes tool-call parser, over the session's
    executor."""
    args = gateway_args(stack.model_dir, stack.executor.address)
    extra = ("--api-key", KEY, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    gateway = ServiceProcess([*args, *extra], "gateway_listening")
    try:
        port = int(gateway.wait_for_event("http_listening")["http_port"])
        wait_serving(gateway.address)
        yield port
    finally:
        assert gateway.stop() == 0


@pytest.fixture(scope="module")
def client(port: int) -> Iterator[anthropic.Anthropic]:
    c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=KEY, max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def chat_client(port: int) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(chat_client: openai.OpenAI) -> str:
    return chat_client.models.list().data[0].id


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_greedy_message_text_equals_the_chat_completions_route(client, chat_client, model) -> None:
    out = client.messages.create(
        model=model, max_tokens=16, system=SYSTEM, messages=ASK, extra_body=GREEDY
    )
    chat = chat_client.chat.completions.create(
        model=model,
        max_tokens=16,
        messages=[{"role": "system", "content": SYSTEM}, *ASK],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.type == "message" and out.role == "assistant" and out.model == model
    assert out.id.startswith("msg_")
    assert _text(out) == chat.choices[0].message.content
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None
    usage = out.usage
    assert usage.output_tokens == 16
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_a_streamed_message_is_the_whole_one_in_anthropics_events(client, model, port) -> None:
    kw = {"model": model, "max_tokens": 12, "messages": ASK, "extra_body": GREEDY}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == _text(whole) == _text(final)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12

    body = {"model": model, "max_tokens": 12, "messages": ASK, "stream": True, **GREEDY}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    url = f"http://127.0.0.1:{port}/v1/messages"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("event: ") :] for line in r.iter_lines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert set(events[3:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_stop_sequence_ends_the_turn_and_is_named(client, model) -> None:
    full = _text(
        client.messages.create(model=model, max_tokens=24, messages=ASK, extra_body=GREEDY)
    )
    words = [w for w in full.split(" ") if len(w) > 2]
    stop = words[len(words) // 2]
    out = client.messages.create(
        model=model, max_tokens=24, messages=ASK, stop_sequences=[stop], extra_body=GREEDY
    )
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert _text(out) == full[: full.index(stop)]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_a_required_tool_choice_returns_a_valid_tool_use_streamed_or_not(
    client, model, choice
) -> None:
    kw = {
        "model": model,
        "max_tokens": 200,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": choice,
        "extra_body": {"temperature": 0},
    }
    out = client.messages.create(**kw)
    assert out.stop_reason == "tool_use"
    uses = [b for b in out.content if b.type == "tool_use"]
    assert uses and all(b.id.startswith("toolu_") for b in uses)
    for use in uses:
        (tool,) = [t for t in TOOLS if t["name"] == use.name]
        jsonschema.validate(use.input, tool["input_schema"])
    if choice["type"] == "tool":
        assert [u.name for u in uses] == ["get_time"]
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (u.name, u.input) for u in uses
    ]


def test_an_auto_tool_choice_returns_the_call_the_model_writes(client, model) -> None:
    """A random model writes no call of its own accord: its output is constrained to a
    Hermes call (vLLM's regex extra, which auto leaves free), read by the gateway's parser."""
    out = client.messages.create(
        model=model,
        max_tokens=200,
        messages=ASK,
        tools=TOOLS,
        extra_body={"temperature": 1.0, "seed": 3, "guided_regex": CALL},
    )
    assert out.stop_reason == "tool_use"
    text, use = out.content
    assert text.type == "text" and text.text == "Checking."
    assert use.type == "tool_use" and use.name == "get_weather"
    assert use.input["city"] in ("Paris", "Oslo")


def test_a_tool_result_turn_reads_as_the_chat_routes_tool_message(
    client, chat_client, model
) -> None:
    call = {"city": "Paris", "unit": "C"}
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": call},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 degrees"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    out = client.messages.create(
        model=model,
        max_tokens=12,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    chat = chat_client.chat.completions.create(
        model=model,
        max_tokens=12,
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps(call)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "21 degrees"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        tools=[WEATHER, TIME],
        tool_choice="none",
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert _text(out) == chat.choices[0].message.content
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_count_tokens_counts_what_the_model_reads_and_reads_come_from_the_cache(
    client, model
) -> None:
    long_ask = [{"role": "user", "content": "Tell me about the weather in Paris. " * 6}]
    counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=long_ask)
    kw = {"model": model, "max_tokens": 4, "system": SYSTEM, "messages": long_ask}
    first = client.messages.create(**kw, extra_body=GREEDY)
    second = client.messages.create(**kw, extra_body=GREEDY)
    for out in (first, second):
        assert out.usage.input_tokens + out.usage.cache_read_input_tokens == counted.input_tokens
    assert second.usage.cache_read_input_tokens >= 16  # at least a block of the prefix
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    pinned = client.messages.create(**{**kw, "system": system}, extra_body=GREEDY)
    assert _text(pinned) == _text(first)


def _post(
    port: int, body: Any, key: str | None = KEY, path: str = "/v1/messages"
) -> httpx.Response:
    headers = {"x-api-key": key} if key else {}
    return httpx.post(f"http://127.0.0.1:{port}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("body", "status", "kind", "named"),
    [
        ({"messages": ASK}, 400, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 0, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            400,
            "invalid_request_error",
            "messages[0].content[0].type",
        ),
        (
            {"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool"}},
            400,
            "invalid_request_error",
            "tool_choice.name",
        ),
        (
            {"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}},
            400,
            "invalid_request_error",
            "tool_choice",
        ),
        (
            {"max_tokens": 4, "messages": ASK, "stop_sequences": [""]},
            400,
            "invalid_request_error",
            "stop_sequences",
        ),
        ({"max_tokens": 4, "messages": ASK, "model": "nope"}, 404, "not_found_error", "nope"),
        ({"max_tokens": 4, "messages": ASK, "seed": "abc"}, 400, "invalid_request_error", "seed"),
        (
            {"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "{"}]},
            400,
            "invalid_request_error",
            "messages[1]",
        ),
    ],
)
def test_bad_requests_are_anthropic_errors_naming_the_field(
    port, model, stack, body, status, kind, named
) -> None:
    r = _post(port, {"model": model, **body})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert named in error["error"]["message"]
    assert stack.wait_blocks_free() == 0


def test_the_api_key_is_read_from_x_api_key_and_a_wrong_one_is_refused(port, model, client) -> None:
    body = {"model": model, "max_tokens": 2, "messages": ASK}
    assert _post(port, body).status_code == 200
    r = _post(port, body, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = anthropic.Anthropic(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=model, max_tokens=2, messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=model, max_tokens=0, messages=ASK)
