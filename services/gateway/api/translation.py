"""A request of another API served as a chat request: Anthropic's Messages and OpenAI's
Responses are translated into the chat route's request, so that one chat template, one
tool-call machinery and one formatter serve all three; each API formats the chat
formatter's objects in its own shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pydantic import ValidationError

from pagedserve.v1 import generation_pb2
from services.gateway.api.http import as_http
from services.gateway.api.openai.errors import rename, validation_error
from services.gateway.api.openai.format import Formatter
from services.gateway.api.openai.protocol import ChatCompletionRequest
from services.gateway.core.generation import GenerationCore
from services.gateway.text.reasoning_parsers import ReasoningParser
from services.gateway.text.tool_parsers import ToolCallParser

__all__ = ["as_chat", "checked"]

T = TypeVar("T")


def checked(translate: Callable[[], T], headers: dict[str, str]) -> T:
    """``translate()``, a body's values that the chat request's model refuses (a vLLM extra
    of the wrong type, passed through as it came) being a 400 naming the field."""
    try:
        return translate()
    except ValidationError as exc:
        error = validation_error(exc.errors())
        error.headers = headers
        raise error from None


def as_chat(
    core: GenerationCore,
    model: str,
    translate: Callable[[], tuple[ChatCompletionRequest, dict[str, str]]],
    *,
    check_model: Callable[[str], str],
    auto_tools: ToolCallParser | None,
    reasoning: ReasoningParser | None,
    headers: dict[str, str],
) -> tuple[generation_pb2.GenerateRequest, Formatter]:
    """The core's request for the chat request ``translate`` makes (with the request's names
    of the fields it translated), and the chat formatter of its answer. A refused request
    raises its HTTP error, naming the request's own fields."""
    names: dict[str, str] = {}  # internal field -> the request's (filled in as it goes)
    with as_http(headers, names):
        lora = check_model(model)
        chat, translated = checked(translate, headers)
        names.update(translated)
        gen = chat.to_generate(auto_tools)
        names.update({k: rename(v, translated) for k, v in chat.field_names.items()})
        gen.lora_name = lora
        calls = chat.tool_calls(auto_tools)
    fmt = Formatter(core, "chat", include_usage=True, logprobs=False)
    fmt.tool_calls = calls
    fmt.auto_tools = auto_tools if chat.auto_tool_choice() else None
    fmt.tool_names = frozenset(chat.tool_names())
    fmt.parallel_tool_calls = chat.parallel_tool_calls
    fmt.field_names = names
    # (A constrained output is all answer: the grammar leaves no room to think.)
    if not gen.sampling_params.HasField("structured_outputs"):
        fmt.reasoning = reasoning
    return gen, fmt
