"""The OpenAI-compatible HTTP front of the gateway (FastAPI), over the same core as gRPC.

Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or Server-Sent Events ending with ``data: [DONE]``),
``POST /v1/embeddings`` (a pooling executor's vectors: ``openai/embeddings.py``), vLLM's
``POST /v1/score`` and ``POST /v1/rerank`` (a reranker's scores: ``openai/scoring.py``), vLLM's
``POST /tokenize`` and ``POST /detokenize``, ``GET /health`` and ``GET /metrics`` (the
gateway's registry); ``POST /v1/responses`` (OpenAI's Responses API, stateless:
``responses_protocol`` / ``responses_format``); and Anthropic's ``POST /v1/messages``
(``services.gateway.api.anthropic``, whose errors take Anthropic's shape).

Every error is OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``
(``openai_errors``), with 400 (invalid request, ``param`` naming the field as the request
spelled it; a body that is not JSON says where it breaks), 401 (API key), 404 (unknown model
or URL), 405 (wrong method), 429 (with ``--max-concurrent-requests`` running and
``--max-queued-requests`` waiting, or the executor refused it for capacity), 500 and 503 (no
executor serving). An error before the first token is the response's status; one after the
stream has started is sent as a last ``data: {"error": ...}`` event, then ``[DONE]``.

Unknown fields are ignored, as vLLM does, but named: in the response's
``x-pagedserve-ignored-fields`` header and a warning in the log (``openai_fields_ignored``).

A client that disconnects aborts its request on the executor at once, as a gRPC cancel does:
while it is queued, waiting for its first token, streaming, or waiting for a whole completion.
A generation response runs its request inside its own ASGI call, watching ``receive`` for
``http.disconnect``, and closes the core's generator before returning (never leaving it to the
garbage collector). Hence no ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware hides
the disconnect from the endpoint; the API key is checked by a pure ASGI middleware.

The JSON objects themselves (errors, completions, chunks, usage) are built by
``openai_format``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import time
from collections.abc import AsyncGenerator
from typing import Any

import structlog
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.v1 import generation_pb2
from services.gateway.api.anthropic.routes import add_messages_routes
from services.gateway.api.http import Completion, EventStream, as_http, ignored_headers
from services.gateway.api.openai import errors as openai_errors
from services.gateway.api.openai.adapters import ModelNames, add_adapter_routes
from services.gateway.api.openai.classify import add_classify_routes
from services.gateway.api.openai.embeddings import add_embedding_routes
from services.gateway.api.openai.errors import HttpError, anthropic_path
from services.gateway.api.openai.format import Formatter
from services.gateway.api.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeBody,
)
from services.gateway.api.openai.responses_format import ResponsesFormatter
from services.gateway.api.openai.responses_protocol import ResponsesRequest
from services.gateway.api.openai.scoring import add_scoring_routes
from services.gateway.api.translation import ChatTranslator
from services.gateway.core.adapters import AdapterService
from services.gateway.core.generation import GenerationCore, GenerationError
from services.gateway.core.validation import DEFAULT_MAX_TOKENS
from services.gateway.text.reasoning_parsers import ReasoningParser
from services.gateway.text.tool_parsers import ToolCallParser

log = structlog.get_logger(__name__)
Responses = AsyncGenerator[generation_pb2.GenerateResponse, None]

_OPEN_PATHS = ("/health", "/metrics")


class _ApiKeyAuth:
    """Pure ASGI middleware: every path but ``/health`` and ``/metrics`` needs the key, as
    ``Authorization: Bearer <key>`` or (Anthropic's clients) ``x-api-key: <key>``; anything
    else is a 401 before the app sees it."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._bearer = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            headers = Headers(scope=scope)
            bearer = headers.get("authorization", "").encode()
            key = headers.get("x-api-key", "").encode()
            # (both compared, whatever the first gives: no timing tells which was sent)
            ok = hmac.compare_digest(bearer, self._bearer) | hmac.compare_digest(key, self._key)
            if not ok:
                error = HttpError(
                    401,
                    "invalid or missing API key (send `Authorization: Bearer <key>` or "
                    "`x-api-key: <key>`)",
                    code="invalid_api_key",
                )
                error.anthropic = anthropic_path(scope["path"])
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    core: GenerationCore,
    *,
    api_key: str | None,
    registry: Any,
    auto_tools: ToolCallParser | None = None,
    reasoning: ReasoningParser | None = None,
    adapters: AdapterService | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``core``; ``auto_tools``: the tool-call parser that
    ``tool_choice: "auto"`` needs (None: auto is refused); ``reasoning``: the parser that
    puts a chat reply's reasoning apart (None: all of it is content)."""
    app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    if api_key:
        app.add_middleware(_ApiKeyAuth, api_key=api_key)
    openai_errors.install(app)

    names = ModelNames(core.model_name, adapters)
    check_model = names.lora_of  # the adapter a request's model names ('' for the base)
    if adapters is not None:
        add_adapter_routes(app, adapters)

    # ---- models, health, metrics -------------------------------------------------------------

    def card() -> dict[str, Any]:
        info = core.pool.info
        out: dict[str, Any] = {
            "id": core.model_name,
            "object": "model",
            "created": created,
            "owned_by": "pagedserve",
        }
        if info is not None:
            out["max_model_len"] = info.max_model_len
        return out

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(), *names.cards(created)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        lora = check_model(model)
        return names.card(lora, created) if lora else card()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if core.pool.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # ---- tokenize / detokenize ---------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> Response:
        headers = ignored_headers(body, "/tokenize")
        with as_http(headers):
            check_model(body.model)
            resp = await core.tokenize(body.to_tokenize())
        info = core.pool.info
        out: dict[str, Any] = {
            "count": len(resp.token_ids),
            "max_model_len": info.max_model_len if info else None,
            "tokens": list(resp.token_ids),
        }
        if body.return_token_strs:
            out["token_strs"] = list(resp.tokens)
        return JSONResponse(out, headers=headers)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> Response:
        headers = ignored_headers(body, "/detokenize")
        with as_http(headers):
            check_model(body.model)
            out = {"prompt": core.detokenize(body.to_detokenize()).text}
        return JSONResponse(out, headers=headers)

    # ---- completions --------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        headers = ignored_headers(body, "/v1/completions")
        prompt_only = body.prompt_only
        with as_http(headers, body.field_names):
            lora = check_model(body.model)
            gens = body.to_generates()
            for gen in gens:
                gen.lora_name = lora
            core.admission.check_fits(len(gens), "prompt", "prompts")
        logprobs = body.logprobs is not None
        fmt = Formatter(core, "completions", body.include_usage, logprobs, body.continuous_usage)
        fmt.echo = body.echo
        fmt.prompt_only = prompt_only
        fmt.field_names = body.field_names
        return _respond(core, gens, DEFAULT_MAX_TOKENS, body.stream, fmt, headers)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> Response:
        headers = ignored_headers(body, "/v1/chat/completions")
        with as_http(headers, body.field_names):
            lora = check_model(body.model)
            gen = body.to_generate(auto_tools)
            gen.lora_name = lora
            calls = body.tool_calls(auto_tools)
        fmt = Formatter(core, "chat", body.include_usage, body.logprobs, body.continuous_usage)
        fmt.for_chat(body, gen, calls, auto_tools, reasoning)
        fmt.field_names = body.field_names
        return _respond(core, [gen], None, body.stream, fmt, headers)

    chat_of = ChatTranslator(core, check_model, auto_tools, reasoning)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest) -> Response:
        headers = ignored_headers(body, "/v1/responses", body.ignored())
        fmt = functools.partial(ResponsesFormatter, request=body)
        return chat_of.respond(body.model, body.to_chat, body.stream, headers, fmt)

    add_messages_routes(app, chat_of)
    add_embedding_routes(app, core, check_model)
    add_scoring_routes(app, core, check_model)
    add_classify_routes(app, core, check_model)
    return app


# ---- responses -------------------------------------------------------------------------------


def _respond(
    core: GenerationCore,
    requests: list[generation_pb2.GenerateRequest],
    default_max_tokens: int | None,
    stream: bool,
    fmt: Formatter,
    headers: dict[str, str],
) -> Response:
    """The response that will run ``requests``, one per prompt (nothing runs before the ASGI
    server calls it), with ``headers``."""
    fmt.choices_per_prompt = requests[0].sampling_params.n or 1
    if len(requests) == 1:
        responses = core.generate(
            requests[0],
            default_max_tokens=default_max_tokens,
            on_prompt=fmt.set_prompt,
        )
    else:
        responses = _merged(core, requests, default_max_tokens, fmt)
    return (EventStream if stream else Completion)(responses, fmt, headers)


def _name_the_prompt(exc: GenerationError, i: int) -> None:
    """An error about prompt ``i`` of a batch names it: ``prompt[i]``, ``prompt[i][j]``; an
    error about another field says which prompt's request it came from."""
    field = exc.field or ""
    for prefix in ("prompt_token_ids.ids", "prompt"):
        if field.startswith(prefix):
            exc.field = f"prompt[{i}]{field[len(prefix) :]}"
            exc.message = exc.message.replace(field, exc.field, 1)
            return
    exc.message = f"{exc.message} (the request of prompt[{i}])"


async def _merged(
    core: GenerationCore,
    requests: list[generation_pb2.GenerateRequest],
    default_max_tokens: int | None,
    fmt: Formatter,
) -> Responses:
    """The responses of several prompts' requests, run concurrently, as they come, with the
    choices of prompt ``i`` renumbered ``i * n + j``. The first error ends them all (the
    others are aborted on their executors); so does closing this generator."""
    n = fmt.choices_per_prompt
    queue: asyncio.Queue[generation_pb2.GenerateResponse | BaseException | None] = asyncio.Queue()

    async def pump(i: int, request: generation_pb2.GenerateRequest) -> None:
        try:
            generation = core.generate(
                request,
                default_max_tokens=default_max_tokens,
                on_prompt=lambda ids: fmt.set_prompt(ids, prompt=i),
            )
            async with contextlib.aclosing(generation) as responses:
                async for r in responses:
                    out = generation_pb2.GenerateResponse()
                    out.CopyFrom(r)
                    out.index = i * n + r.index
                    queue.put_nowait(out)
        except Exception as exc:  # handed to the consumer, which raises it
            if isinstance(exc, GenerationError):
                _name_the_prompt(exc, i)
            queue.put_nowait(exc)
            return
        queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
