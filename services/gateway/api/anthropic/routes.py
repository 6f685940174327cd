"""Anthropic's Messages API on the gateway's HTTP front: ``POST /v1/messages`` (a message,
or its event stream) and ``POST /v1/messages/count_tokens``.

A request is translated into the chat request of the OpenAI front (``protocol``) and served
by the same core, chat template and tool machinery; its answer is formatted in Anthropic's
shapes (``format``). Errors are Anthropic's ``{"type": "error", "error": {"type",
"message"}}``, naming the request's own fields; the API key may come as ``x-api-key``.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from services.gateway.api.anthropic.format import MessagesFormatter
from services.gateway.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from services.gateway.api.http import as_http, ignored_headers
from services.gateway.api.openai.protocol import TokenizeBody
from services.gateway.api.translation import ChatTranslator, checked

__all__ = ["add_messages_routes"]


def add_messages_routes(app: FastAPI, chat: ChatTranslator) -> None:
    """Serve Anthropic's Messages API on ``app``, as chat requests through ``chat``."""

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest) -> Response:
        headers = ignored_headers(body, "/v1/messages", body.ignored())
        return chat.respond(body.model, body.to_chat, body.stream, headers, MessagesFormatter)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> Response:
        headers = ignored_headers(body, "/v1/messages/count_tokens")
        with as_http(headers):
            chat.check_model(body.model)
            tokenize = checked(
                lambda: TokenizeBody.model_validate(body.to_tokenize()), headers
            ).to_tokenize()
            resp = await chat.core.tokenize(tokenize)
        return JSONResponse({"input_tokens": len(resp.token_ids)}, headers=headers)
