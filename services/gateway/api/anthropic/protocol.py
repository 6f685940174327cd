"""Anthropic's Messages request (``POST /v1/messages``), translated into the chat request of
the OpenAI front, whose machinery (chat template, tool-call grammars and parsers, sampling,
structured outputs) then serves it.

The translation, field by field:

- ``system`` (a string or text blocks) is the first, system message;
- a user turn's ``tool_result`` blocks become tool messages answering the calls they name,
  before the turn's text; an assistant turn's ``tool_use`` blocks become its tool calls (their
  ``input`` as JSON arguments); ``thinking`` blocks of earlier turns are dropped, as
  Anthropic's own API drops them from the context;
- ``tools`` are functions (``input_schema`` their parameters); ``tool_choice`` ``auto`` /
  ``any`` / ``tool`` / ``none`` are OpenAI's ``auto`` / ``required`` / the named function /
  ``none``, and ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``;
- ``stop_sequences`` are stop strings, ``metadata.user_id`` the user, ``max_tokens``,
  ``temperature``, ``top_p`` and ``top_k`` as they are; vLLM's extras (``min_p``, ``seed``,
  ``structured_outputs``, ``guided_regex``, ...) are read too, as the OpenAI routes read them;
- ``cache_control`` on any block or tool pins the request's prefix for its TTL (``5m`` by
  default, or ``1h``): the block manager's session pins (``kv_pin_ttl_s``).

Images and documents are refused (the served models read text), naming the block; so is a
conversation ending in an assistant turn (Anthropic's prefill, which the reply would
continue: the chat template here always opens a new turn).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.common.limits import FieldError
from services.gateway.api.http import ignored_fields
from services.gateway.api.openai.protocol import ChatCompletionRequest
from services.gateway.api.translation import SAMPLING_EXTRAS

__all__ = ["CountTokensRequest", "MessagesRequest"]

_PIN_TTL_S = {"5m": 300.0, "1h": 3600.0}


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] = "5m"


class Block(BaseModel):
    """A content block of a message or of ``system``; which fields matter depends on
    ``type`` (text, tool_use, tool_result, thinking, ...)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: Any = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking
    signature: str | None = None  # thinking
    cache_control: CacheControl | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" (or absent); Anthropic's server tools are refused
    cache_control: CacheControl | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow")

    user_id: str | None = None


class _Conversation(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def _chat(self) -> tuple[dict[str, Any], dict[str, str], float | None]:
        """The chat request's messages and tools, the field names they were translated from
        (errors name the request's own), and the longest ``cache_control`` TTL."""
        names: dict[str, str] = {}
        ttls: list[float] = []
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            messages.append(
                {"role": "system", "content": _text(self.system, "system", ttls, allow=())}
            )
        if self.messages and self.messages[-1].role == "assistant":
            raise FieldError(
                f"messages[{len(self.messages) - 1}]",
                "a final assistant turn (a prefill the reply would continue) is not "
                "supported: end the conversation with a user turn",
            )
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            for out in _turn(m, where, ttls):
                names[f"messages[{len(messages)}]"] = where
                messages.append(out)
        chat: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            chat["tools"] = []
            for j, tool in enumerate(self.tools):
                if tool.type not in (None, "custom"):
                    raise FieldError(
                        f"tools[{j}].type",
                        f"{tool.type!r} is one of Anthropic's server tools: only client tools "
                        '(type "custom", or none) are served here',
                    )
                if tool.cache_control is not None:
                    ttls.append(_PIN_TTL_S[tool.cache_control.ttl])
                fn: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
                if tool.description is not None:
                    fn["description"] = tool.description
                chat["tools"].append({"type": "function", "function": fn})
                names[f"tools[{j}].function.parameters"] = f"tools[{j}].input_schema"
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                if not choice.name:
                    raise FieldError("tool_choice.name", 'is required with type "tool"')
                chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
                names["tool_choice.function.name"] = "tool_choice.name"
            else:
                chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                    choice.type
                ]
            chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return chat, names, max(ttls) if ttls else None


class MessagesRequest(_Conversation):
    """``POST /v1/messages``: Anthropic's fields (others are ignored and named, as on the
    OpenAI routes)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    # Read and honoured as far as they go: extended thinking is the model's own (a reasoning
    # parser puts it apart); no budget is enforced but max_tokens.
    thinking: dict[str, Any] | None = None

    def to_chat(self) -> tuple[ChatCompletionRequest, dict[str, str]]:
        """The chat request that serves this one, and the request's names of the fields it
        was translated into (for errors)."""
        chat, names, ttl = self._chat()
        chat.update(max_tokens=self.max_tokens, stream=self.stream)
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.stop_sequences:
            chat["stop"] = self.stop_sequences
            names["stop"] = "stop_sequences"
        if self.metadata is not None and self.metadata.user_id is not None:
            chat["user"] = self.metadata.user_id
        extra = self.model_extra or {}
        chat.update({k: extra[k] for k in SAMPLING_EXTRAS if extra.get(k) is not None})
        if ttl is not None and "kv_pin_ttl_s" not in chat:
            chat["kv_pin_ttl_s"] = ttl
        return ChatCompletionRequest.model_validate(chat), names

    def ignored(self) -> list[str]:
        """The body's fields nothing reads (the sampling extras above are read)."""
        return [f for f in ignored_fields(self) if f not in SAMPLING_EXTRAS and f != "thinking"]


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``: the conversation and tools, as the model sees
    them."""

    def to_tokenize(self) -> dict[str, Any]:
        chat, _, _ = self._chat()
        return {"model": self.model, "messages": chat["messages"], "tools": chat.get("tools")}


def _turn(m: Message, where: str, ttls: list[float]) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's tool results first (a tool message
    each), then its text; an assistant turn's text and tool calls."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(m.content):
        at = f"{where}.content[{j}]"
        if block.cache_control is not None:
            ttls.append(_PIN_TTL_S[block.cache_control.ttl])
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_result" and m.role == "user":
            if not block.tool_use_id:
                raise FieldError(f"{at}.tool_use_id", "is required in a tool_result block")
            content = _text(block.content or "", f"{at}.content", ttls, allow=())
            if block.is_error:
                content = f"Error: {content}"
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif block.type == "tool_use" and m.role == "assistant":
            if not block.name or not block.id:
                raise FieldError(at, "a tool_use block needs an id and a name")
            arguments = json.dumps(block.input if block.input is not None else {})
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        elif block.type in ("thinking", "redacted_thinking") and m.role == "assistant":
            continue  # (earlier turns' thinking is not shown to the model again)
        else:
            raise FieldError(
                f"{at}.type",
                f"a {block.type!r} block is not supported in a {m.role} turn (text"
                + (", tool_result" if m.role == "user" else ", tool_use, thinking")
                + " are)",
            )
    if texts or calls or not out:
        turn: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _text(content: str | list[Block], where: str, ttls: list[float], allow: tuple[str, ...]) -> str:
    """The text of ``system`` or of a tool result: a string, or text blocks joined."""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        if block.cache_control is not None:
            ttls.append(_PIN_TTL_S[block.cache_control.ttl])
        if block.type != "text" and block.type not in allow:
            raise FieldError(
                f"{where}[{j}].type", f"only text blocks are supported here, got {block.type!r}"
            )
        parts.append(block.text or "")
    return "\n".join(parts) if where == "system" else "".join(parts)
