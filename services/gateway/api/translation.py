"""A request of another API served as a chat request: Anthropic's Messages and OpenAI's
Responses are translated into the chat route's request, so that one chat template, one
tool-call machinery and one formatter serve all three; each API formats the chat
formatter's objects in its own shapes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi.responses import Response
from pydantic import ValidationError

from pagedserve.v1 import generation_pb2
from services.gateway.api.http import Completion, EventStream, ResponseFormatter, as_http
from services.gateway.api.openai.errors import rename, validation_error
from services.gateway.api.openai.format import Formatter
from services.gateway.api.openai.protocol import ChatCompletionRequest
from services.gateway.core.generation import GenerationCore
from services.gateway.text.reasoning_parsers import ReasoningParser
from services.gateway.text.tool_parsers import ToolCallParser

__all__ = ["SAMPLING_EXTRAS", "ChatTranslator", "checked"]

T = TypeVar("T")

#: vLLM's extras of the chat route that a translated request passes through as they come.
SAMPLING_EXTRAS = (
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "logit_bias",
    "priority",
    "cache_salt",
    "request_id",
    "kv_retention_priority",
    "kv_pin_ttl_s",
    "skip_special_tokens",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def checked(translate: Callable[[], T], headers: dict[str, str]) -> T:
    """``translate()``, a body's values that the chat request's model refuses (a vLLM extra
    of the wrong type, passed through as it came) being a 400 naming the field."""
    try:
        return translate()
    except ValidationError as exc:
        error = validation_error(exc.errors())
        error.headers = headers
        raise error from None


@dataclass(frozen=True)
class ChatTranslator:
    """Serves a request of another API as a chat request: ``check_model`` gives the LoRA
    adapter a model name selects ('' for the base model) or refuses it (404);
    ``auto_tools`` / ``reasoning``: the gateway's tool-call and reasoning parsers."""

    core: GenerationCore
    check_model: Callable[[str], str]
    auto_tools: ToolCallParser | None
    reasoning: ReasoningParser | None

    def respond(
        self,
        model: str,
        translate: Callable[[], tuple[ChatCompletionRequest, dict[str, str]]],
        stream: bool,
        headers: dict[str, str],
        formatter: Callable[[Formatter], ResponseFormatter],
    ) -> Response:
        """The response that runs the chat request ``translate`` makes (with the request's
        names of the fields it translated), its answer formatted by ``formatter`` over the
        chat formatter. A refused request raises its HTTP error, naming the request's own
        fields."""
        gen, fmt = self._chat(model, translate, headers)
        core = self.core
        out = core.generate(gen, default_max_tokens=None, on_prompt=fmt.set_prompt)
        return (EventStream if stream else Completion)(out, formatter(fmt), headers)

    def _chat(
        self,
        model: str,
        translate: Callable[[], tuple[ChatCompletionRequest, dict[str, str]]],
        headers: dict[str, str],
    ) -> tuple[generation_pb2.GenerateRequest, Formatter]:
        auto_tools = self.auto_tools
        names: dict[str, str] = {}  # internal field -> the request's (filled in as it goes)
        with as_http(headers, names):
            lora = self.check_model(model)
            chat, translated = checked(translate, headers)
            names.update(translated)
            gen = chat.to_generate(auto_tools)
            names.update({k: rename(v, translated) for k, v in chat.field_names.items()})
            gen.lora_name = lora
            calls = chat.tool_calls(auto_tools)
        fmt = Formatter(self.core, "chat", include_usage=True, logprobs=False)
        fmt.for_chat(chat, gen, calls, auto_tools, self.reasoning)
        fmt.field_names = names
        return gen, fmt
