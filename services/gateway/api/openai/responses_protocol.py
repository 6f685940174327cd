"""OpenAI's Responses request (``POST /v1/responses``), in its stateless form, translated into
the chat request of this front, whose machinery (chat template, tool-call grammars and
parsers, structured outputs, sampling) then serves it.

The translation:

- ``instructions`` is the first, system message; ``input`` is a string (one user message) or
  items: messages (``role`` user / system / developer / assistant, ``content`` a string or
  ``input_text`` / ``output_text`` parts), ``function_call`` items (an assistant turn's calls)
  and ``function_call_output`` items (tool messages); ``reasoning`` items of earlier turns are
  dropped;
- ``tools`` are functions (Responses' flat ``{"type": "function", "name", "parameters"}``),
  ``tool_choice`` and ``parallel_tool_calls`` as on the chat route (a named function as
  ``{"type": "function", "name"}``);
- ``text.format`` ``json_schema`` / ``json_object`` is the chat route's ``response_format``;
- ``max_output_tokens`` is ``max_tokens``; ``temperature``, ``top_p``, ``user`` as they are,
  and vLLM's extras (``seed``, ``top_k``, ``structured_outputs``, ...) as the chat route reads
  them.

Nothing is stored: ``store: true`` and ``previous_response_id`` are refused (400, naming the
field), since a response kept by this gateway would be lost on its restart and unseen by its
replicas.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.common.limits import FieldError
from services.gateway.api.http import ignored_fields
from services.gateway.api.openai.protocol import ChatCompletionRequest
from services.gateway.api.translation import SAMPLING_EXTRAS

__all__ = ["ResponsesRequest"]

# (and Responses has no top_k nor stop of its own: vLLM's are read)
_EXTRAS = ("top_k", "stop", *SAMPLING_EXTRAS)


class InputItem(BaseModel):
    """An item of ``input``: a message (``type`` ``message`` or absent), a function call, a
    function call's output, or a reasoning item."""

    model_config = ConfigDict(extra="allow")

    type: str = "message"
    role: str | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    output: str | list[dict[str, Any]] | None = None  # function_call_output


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: dict[str, Any] | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: OpenAI's fields (others are ignored and named)."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None  # (the model's own; a reasoning parser splits it)
    truncation: Literal["disabled", "auto"] | None = None

    def to_chat(self) -> tuple[ChatCompletionRequest, dict[str, str]]:
        """The chat request that serves this one, and the request's names of the fields it
        was translated into (for errors)."""
        if self.store:
            raise FieldError(
                "store",
                "responses are not stored by this server (stateless): send store=false, and "
                "the whole conversation in input",
            )
        if self.previous_response_id is not None:
            raise FieldError(
                "previous_response_id",
                "responses are not stored by this server: send the whole conversation in input",
            )
        names: dict[str, str] = {"max_tokens": "max_output_tokens"}
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for i, item in enumerate(self.input):
                names[f"messages[{len(messages)}]"] = f"input[{i}]"
                _add_item(messages, item, f"input[{i}]")
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        for name in ("temperature", "top_p", "user"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            chat["max_tokens"] = self.max_output_tokens
        if self.tools:
            chat["tools"] = [_tool(t, j, names) for j, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            chat["tool_choice"] = _tool_choice(self.tool_choice, names)
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.get("type") != "text":
            chat["response_format"] = _response_format(fmt, names)
        extra = self.model_extra or {}
        chat.update({k: extra[k] for k in _EXTRAS if extra.get(k) is not None})
        return ChatCompletionRequest.model_validate(chat), names

    def ignored(self) -> list[str]:
        """The body's fields nothing reads (the extras above are read; ``reasoning`` and
        ``truncation`` are accepted as the model's own and as ``disabled``)."""
        return [f for f in ignored_fields(self) if f not in _EXTRAS]


def _add_item(messages: list[dict[str, Any]], item: InputItem, where: str) -> None:
    if item.type == "message":
        if item.role not in ("user", "system", "developer", "assistant"):
            raise FieldError(f"{where}.role", "must be user, system, developer or assistant")
        role = "system" if item.role == "developer" else item.role
        messages.append({"role": role, "content": _content(item.content, f"{where}.content")})
    elif item.type == "function_call":
        if not item.name or not item.call_id:
            raise FieldError(where, "a function_call item needs a call_id and a name")
        call = {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments or "{}"},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            # (the same turn's text and calls, one item after another: one assistant turn)
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif item.type == "function_call_output":
        if not item.call_id:
            raise FieldError(f"{where}.call_id", "is required in a function_call_output item")
        output = _content(item.output, f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    elif item.type == "reasoning":
        return  # (earlier turns' reasoning is not shown to the model again)
    else:
        raise FieldError(
            f"{where}.type",
            f"{item.type!r} items are not supported (message, function_call, "
            "function_call_output and reasoning are)",
        )


def _content(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.get("type") not in ("input_text", "output_text", "text"):
            raise FieldError(
                f"{where}[{j}].type",
                f"only text parts are supported (the model reads text), got {part.get('type')!r}",
            )
        parts.append(str(part.get("text") or ""))
    return "".join(parts)


def _tool(tool: dict[str, Any], j: int, names: dict[str, str]) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise FieldError(
            f"tools[{j}]",
            "only function tools ({type: function, name, parameters}) are served here",
        )
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    names[f"tools[{j}].function.parameters"] = f"tools[{j}].parameters"
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any], names: dict[str, str]) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        names["tool_choice.function.name"] = "tool_choice.name"
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # auto / none / required, or refused by the chat route, naming it


def _response_format(fmt: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    kind = fmt.get("type")
    if kind == "json_object":
        names["response_format"] = "text.format"
        return {"type": "json_object"}
    if kind == "json_schema":
        names["response_format.json_schema.schema"] = "text.format.schema"
        names["response_format"] = "text.format"
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise FieldError("text.format.type", "must be text, json_schema or json_object")
