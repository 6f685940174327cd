"""Anthropic's Messages API on the gateway's HTTP front: ``POST /v1/messages`` (a message,
or its event stream) and ``POST /v1/messages/count_tokens``.

A request is translated into the chat request of the OpenAI front (``protocol``) and served
by the same core, chat template and tool machinery; its answer is formatted in Anthropic's
shapes (``format``). Errors are Anthropic's ``{"type": "error", "error": {"type",
"message"}}``, naming the request's own fields; the API key may come as ``x-api-key``.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from services.gateway.api.anthropic.format import MessagesFormatter
from services.gateway.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from services.gateway.api.http import Completion, EventStream, as_http, ignored_headers
from services.gateway.api.openai.protocol import TokenizeBody
from services.gateway.api.translation import as_chat, checked
from services.gateway.core.generation import GenerationCore
from services.gateway.text.reasoning_parsers import ReasoningParser
from services.gateway.text.tool_parsers import ToolCallParser

__all__ = ["add_messages_routes"]


def add_messages_routes(
    app: FastAPI,
    core: GenerationCore,
    *,
    check_model: Callable[[str], str],
    auto_tools: ToolCallParser | None,
    reasoning: ReasoningParser | None,
) -> None:
    """Serve Anthropic's Messages API on ``app``; ``check_model`` gives the LoRA adapter a
    model name selects ('' for the base model) or refuses it (404)."""

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest) -> Response:
        headers = ignored_headers(body, "/v1/messages", body.ignored())
        gen, fmt = as_chat(
            core,
            body.model,
            body.to_chat,
            check_model=check_model,
            auto_tools=auto_tools,
            reasoning=reasoning,
            headers=headers,
        )
        responses = core.generate(gen, default_max_tokens=None, on_prompt=fmt.set_prompt)
        answer = EventStream if body.stream else Completion
        return answer(responses, MessagesFormatter(fmt), headers)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> Response:
        headers = ignored_headers(body, "/v1/messages/count_tokens")
        with as_http(headers):
            check_model(body.model)
            tokenize = checked(
                lambda: TokenizeBody.model_validate(body.to_tokenize()), headers
            ).to_tokenize()
            resp = await core.tokenize(tokenize)
        return JSONResponse({"input_tokens": len(resp.token_ids)}, headers=headers)
