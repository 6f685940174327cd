"""``tool_choice: "auto"`` through a real gateway started with ``--enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3``, in front of the session's executor: the
calls the model writes come back as ``tool_calls`` with the text before them as content,
streamed or not; a reply without a call or a thought is plain text, the same streamed or not.

A random-weight model writes no tool call of its own accord, so the call is made to happen by
constraining its output to a Hermes call (vLLM's ``structured_outputs`` regex, which ``auto``
leaves free): real tokens through the real detokenizer and parser."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from pagedserve.testing.procs import ServiceProcess, gateway_args, wait_serving
from tests.gateway.conftest import Stack
from tests.gateway.test_structured_outputs_e2e import ASK, TIME, WEATHER

CALL = (
    r'Checking\.<tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Oslo)", "unit": "(C|F)"\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    args = gateway_args(
        stack.model_dir, stack.executor.address, "--http-port", "0", "--metrics-port", "-1"
    )
    gateway = ServiceProcess(
        [
            *args,
            *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
            *("--reasoning-parser", "qwen3"),
        ],
        "gateway_listening",
    )
    try:
        port = int(gateway.wait_for_event("http_listening")["http_port"])
        wait_serving(gateway.address)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        yield c
        c.close()
    finally:
        assert gateway.stop() == 0


def _ask(client: openai.OpenAI, **kw):
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], **kw)


def test_a_call_the_model_writes_is_returned_as_tool_calls_streamed_or_not(client) -> None:
    kw = {"temperature": 1.0, "seed": 3, "max_tokens": 200, "extra_body": {"guided_regex": CALL}}
    out = _ask(client, **kw)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("C", "F")

    chunks = list(_ask(client, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (call.function.name, call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_reply_without_a_call_is_text_the_same_streamed_or_not(client) -> None:
    kw = {"temperature": 0, "max_tokens": 40}  # the tool choice is auto by default
    (choice,) = _ask(client, **kw).choices
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.message.model_extra["reasoning_content"] is None  # no <think> block
    chunks = list(_ask(client, stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
