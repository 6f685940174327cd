"""OpenAI's Responses API (``POST /v1/responses``, stateless) of a real gateway process, driven
by the official ``openai`` client: greedy text equal to the chat completions route for the
same conversation, streamed (typed events) or not; a cut output is ``incomplete``; a
``json_schema`` text format whose output validates; function calls with ``tool_choice``
required / named and a function-call-output turn; ``store`` and ``previous_response_id``
refused naming the field; no block left in use."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from services.gateway.api.openai.responses_protocol import ResponsesRequest
from tests.gateway.conftest import Stack
from tests.gateway.test_openai_api import base_url
from tests.gateway.test_structured_outputs_e2e import TIME, WEATHER

ASK = "What is the weather in Paris?"
INSTRUCTIONS = "Be brief."
GREEDY = {"ignore_eos": True}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "degrees": {"type": "integer"}},
    "required": ["city", "degrees"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=base_url(stack.http_port), api_key="unused", max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _chat_text(client: openai.OpenAI, model: str, messages: list, **kw) -> tuple[str, int]:
    out = client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)
    return out.choices[0].message.content, out.usage.prompt_tokens


def test_greedy_response_text_equals_the_chat_completions_route(client, model, stack) -> None:
    out = client.responses.create(
        model=model,
        input=ASK,
        instructions=INSTRUCTIONS,
        max_output_tokens=16,
        temperature=0,
        extra_body=GREEDY,
    )
    text, prompt = _chat_text(
        client,
        model,
        [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK}],
        max_tokens=16,
        extra_body=GREEDY,
    )
    assert out.object == "response" and out.id.startswith("resp_") and out.model == model
    assert out.output_text == text
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.input_tokens == prompt and out.usage.output_tokens == 16
    assert out.store is False
    assert stack.wait_blocks_free() == 0


def test_a_streamed_response_is_the_whole_one_in_typed_events(client, model) -> None:
    kw = {"model": model, "input": ASK, "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**kw, extra_body=GREEDY)
    events = list(client.responses.create(**kw, stream=True, extra_body=GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    usage = events[-1].response.usage  # (its cached tokens: the first request's blocks)
    assert (usage.input_tokens, usage.output_tokens) == (whole.usage.input_tokens, 12)
    # (the SDK's stream helper, like OpenAI's server, ends an incomplete response with
    # response.incomplete: its get_final_response wants a completed one, as the json_schema
    # test below streams)


def test_a_json_schema_text_format_gives_output_that_validates_streamed_or_not(
    client, model
) -> None:
    fmt = {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}
    kw = {"model": model, "input": ASK, "max_output_tokens": 60, "text": {"format": fmt}}
    out = client.responses.create(**kw, temperature=0)
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    with client.responses.stream(**kw, temperature=0) as stream:
        final = stream.get_final_response()
    assert final.output_text == out.output_text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_a_required_tool_choice_returns_function_calls_streamed_or_not(
    client, model, choice
) -> None:
    kw = {
        "model": model,
        "input": ASK,
        "tools": TOOLS,
        "tool_choice": choice,
        "max_output_tokens": 200,
        "temperature": 0,
    }
    out = client.responses.create(**kw)
    calls = [o for o in out.output if o.type == "function_call"]
    assert calls and out.status == "completed"
    for call in calls:
        (tool,) = [t for t in TOOLS if t["name"] == call.name]
        jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    if isinstance(choice, dict):
        assert [c.name for c in calls] == ["get_time"]
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]


def test_a_function_call_output_turn_reads_as_the_chat_routes_tool_message(client, model) -> None:
    arguments = json.dumps({"city": "Paris", "unit": "C"})
    out = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": ASK},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": arguments,
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees"},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=12,
        temperature=0,
        extra_body=GREEDY,
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    text, prompt = _chat_text(
        client,
        model,
        [
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
        ],
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_tokens=12,
        extra_body=GREEDY,
    )
    assert out.output_text == text and out.usage.input_tokens == prompt


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"store": True}, "store"),
        ({"top_k": "x"}, "top_k"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}},
            "text.format.schema",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_field(client, model, stack, body, named) -> None:
    r = httpx.post(
        f"{base_url(stack.http_port)}/responses",
        json={"model": model, "input": ASK, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == named, error
    assert stack.wait_blocks_free() == 0


def test_a_turns_text_and_its_calls_are_one_assistant_message() -> None:
    """Replaying a response's output (a message item, then its function calls) gives one
    assistant turn with its text and calls, as the chat route's request has it."""
    request = ResponsesRequest(
        model="m",
        input=[
            {"role": "user", "content": ASK},
            {"type": "message", "role": "assistant", "content": "Let me check."},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "21"},
            {"type": "function_call_output", "call_id": "c2", "output": "noon"},
        ],
    )
    chat, names = request.to_chat()
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "tool"]
    turn = chat.messages[1]
    assert turn.content == "Let me check."
    assert [c["id"] for c in turn.tool_calls or ()] == ["c1", "c2"]
    assert names["messages[2]"] == "input[4]"
