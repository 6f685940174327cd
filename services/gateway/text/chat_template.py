"""Chat messages through the model's chat template: the proto's messages as transformers'
templates read them (OpenAI's shape: an assistant turn's ``tool_calls`` with their
arguments as objects, a tool result's ``tool_call_id``), rendered and tokenized."""

from __future__ import annotations

import json
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from pagedserve.v1 import generation_pb2
from services.common.limits import FieldError


def template_messages(messages: generation_pb2.ChatMessages, field: str) -> list[dict[str, Any]]:
    """The messages as a chat template reads them; a call's arguments that are not a JSON
    object are INVALID_ARGUMENT naming them."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                where = f"{field}.messages[{i}].tool_calls[{j}]"
                if not call.name:
                    raise FieldError(f"{where}.name", "must not be empty")
                try:
                    arguments = json.loads(call.arguments or "{}")
                except (ValueError, RecursionError) as e:  # (RecursionError: nested too deep)
                    raise FieldError(f"{where}.arguments", f"is not JSON: {e}") from None
                if not isinstance(arguments, dict):
                    raise FieldError(f"{where}.arguments", "must be a JSON object")
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": arguments},
                    }
                )
            message["tool_calls"] = calls
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        out.append(message)
    return out


def chat_ids(
    tokenizer: PreTrainedTokenizerBase, messages: generation_pb2.ChatMessages, field: str
) -> list[int]:
    """The prompt's token ids: the messages and tools through the model's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise FieldError(field, "the model has no chat template")
    add_prompt = (
        messages.add_generation_prompt if messages.HasField("add_generation_prompt") else True
    )
    try:
        tools = [json.loads(t) for t in messages.tools] or None
    except (ValueError, RecursionError) as e:
        raise FieldError(f"{field}.tools", f"is not JSON: {e}") from None
    try:
        text = tokenizer.apply_chat_template(
            template_messages(messages, field),
            tools=tools,
            add_generation_prompt=add_prompt,
            tokenize=False,
        )
    except jinja2.TemplateError as e:  # the model's template refuses this conversation
        raise FieldError(field, f"the chat template refused the messages: {e}") from None
    # The template writes its own special tokens (BOS): tokenize without adding more.
    return tokenizer(text, add_special_tokens=False).input_ids
