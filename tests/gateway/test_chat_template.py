"""A tool-using conversation through the chat template: an assistant turn's calls and the
tool results sent back (OpenAI's shape, over HTTP or as the gRPC ``ChatMessage`` fields) reach
the model's template as transformers documents them, so the prompt is the one the model was
trained on; what cannot be rendered is INVALID_ARGUMENT naming it."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedserve.tools.tiny_tokenizer import FAMILY_TEMPLATES, build_tokenizer, save_tokenizer
from pagedserve.v1 import generation_pb2 as G
from services.common.limits import FieldError
from services.gateway.api.openai.protocol import ChatCompletionRequest
from services.gateway.core.validation import check_messages, check_prompt_bytes
from services.gateway.text.chat_template import chat_ids
from services.gateway.text.tool_parsers import tool_call_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# As an OpenAI client sends the second turn of a tool call: the assistant's call (arguments as
# a JSON string), the tool's result answering it, and the user's next message.
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "4 C"},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """The tiny tokenizer with Qwen3's chat template (tools included)."""
    path = tmp_path_factory.mktemp("qwen_tokenizer")
    save_tokenizer(
        build_tokenizer(), path, model_max_length=4096, chat_template=FAMILY_TEMPLATES["qwen3"]
    )
    return AutoTokenizer.from_pretrained(path)


def _as_transformers_documents_it(messages: list[dict]) -> list[dict]:
    """The conversation as transformers' chat templates expect it: arguments as objects."""
    out = []
    for m in messages:
        m = {**m, "content": m["content"] or ""}
        if "tool_calls" in m:
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def test_a_tool_conversation_over_http_renders_as_transformers_renders_it(qwen_tokenizer) -> None:
    body = ChatCompletionRequest(
        model="m", messages=CONVERSATION, tools=[WEATHER], tool_choice="none"
    )
    request = body.to_generate()
    assert request.messages.messages[2].tool_calls[1] == G.ToolCall(
        id="call_2", name="get_weather", arguments='{"city": "Oslo"}'
    )
    assert request.messages.messages[3].tool_call_id == "call_1"
    request.messages.tools.append(json.dumps(WEATHER))  # (tool_choice none hides them)
    check_messages(request.messages, "messages")
    ids = chat_ids(qwen_tokenizer, request.messages, "messages")
    expected = qwen_tokenizer.apply_chat_template(
        _as_transformers_documents_it(CONVERSATION),
        tools=[WEATHER],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert ids == qwen_tokenizer(expected, add_special_tokens=False).input_ids
    text = qwen_tokenizer.decode(ids)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    )
    assert "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n4 C\n</tool_response>" in text


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ("{not json", "messages.messages[0].tool_calls[0].arguments"),
        ("[1, 2]", "messages.messages[0].tool_calls[0].arguments"),
        ("[" * 5000, "messages.messages[0].tool_calls[0].arguments"),  # nested too deep
    ],
)
def test_call_arguments_that_are_no_json_object_are_refused_naming_them(
    qwen_tokenizer, arguments: str, field: str
) -> None:
    messages = G.ChatMessages(
        messages=[
            G.ChatMessage(
                role="assistant", tool_calls=[G.ToolCall(id="c", name="f", arguments=arguments)]
            )
        ]
    )
    with pytest.raises(FieldError) as info:
        chat_ids(qwen_tokenizer, messages, "messages")
    assert info.value.field == field


def test_tool_calls_on_a_turn_other_than_the_assistants_are_refused() -> None:
    messages = G.ChatMessages(
        messages=[G.ChatMessage(role="user", tool_calls=[G.ToolCall(name="f", arguments="{}")])]
    )
    with pytest.raises(FieldError) as info:
        check_messages(messages, "messages")
    assert info.value.field == "messages.messages[0].tool_calls"


def test_the_default_tiny_model_shows_tools_and_calls_as_the_hermes_parser_reads_them(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """The default (llama) tiny checkpoint's template: without tools, the conversation as
    before; with them, their signatures in the system turn (one line each: the tiny tokenizer
    spends some 200 tokens on a tool's JSON) and earlier calls as ``<tool_call>`` blocks that
    ``--tool-call-parser hermes`` parses back."""
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    conversation = _as_transformers_documents_it(CONVERSATION)
    text = tokenizer.apply_chat_template(
        conversation, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<s><|system|>\nBe brief.\n\n# Tools\n")
    assert "<tools>\nget_weather(city)\n</tools>\nCall a tool as <tool_call>" in text
    assert text.count("<|system|>") == 1 and text.endswith("<|assistant|>\n")
    assert "<|tool|>\n<tool_response>\n18 C\n</tool_response></s>" in text
    reply = text.split("<|assistant|>\n")[1].split("</s>")[0]
    parsed = tool_call_parser("hermes").parse(reply, {"get_weather"})
    assert parsed.calls == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_weather", '{"city": "Oslo"}'),
    ]
    no_system = tokenizer.apply_chat_template(conversation[1:], tools=[WEATHER], tokenize=False)
    assert no_system.startswith("<s><|system|>\n# Tools\n")


def test_the_prompt_size_limit_counts_every_string_of_the_messages_and_the_tools() -> None:
    """The role (9), the call's name (1) and arguments (90), the tools (20): 120 bytes."""
    messages = G.ChatMessages(
        messages=[
            G.ChatMessage(role="assistant", tool_calls=[G.ToolCall(name="f", arguments="x" * 90)])
        ],
        tools=["y" * 20],
    )
    check_prompt_bytes("messages", messages, 120)
    with pytest.raises(FieldError):
        check_prompt_bytes("messages", messages, 119)
