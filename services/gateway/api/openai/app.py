"""The OpenAI-compatible HTTP front of the gateway (FastAPI), over the same core as gRPC.

Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or Server-Sent Events ending with ``data: [DONE]``), vLLM's
``POST /tokenize`` and ``POST /detokenize``, ``GET /health`` and ``GET /metrics`` (the
gateway's registry).

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
import hmac
import json
import time
from collections.abc import AsyncGenerator, Coroutine, Iterator
from typing import Any

import structlog
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.v1 import generation_pb2
from services.common.limits import FieldError
from services.gateway.api.openai import errors as openai_errors
from services.gateway.api.openai.adapters import ModelNames, add_adapter_routes
from services.gateway.api.openai.errors import HttpError
from services.gateway.api.openai.format import Formatter
from services.gateway.api.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeBody,
)
from services.gateway.core.adapters import AdapterService
from services.gateway.core.generation import GenerationCore, GenerationError
from services.gateway.core.validation import DEFAULT_MAX_TOKENS
from services.gateway.text.reasoning_parsers import ReasoningParser
from services.gateway.text.tool_parsers import ToolCallParser

log = structlog.get_logger(__name__)
Responses = AsyncGenerator[generation_pb2.GenerateResponse, None]

_OPEN_PATHS = ("/health", "/metrics")
IGNORED_HEADER = "x-pagedserve-ignored-fields"
_MAX_NAMED = 32  # ignored fields named in the header and the log


class _ApiKeyAuth:
    """Pure ASGI middleware: every path but ``/health`` and ``/metrics`` needs
    ``Authorization: Bearer <key>``; anything else is a 401 before the app sees it."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            given = Headers(scope=scope).get("authorization", "")
            if not hmac.compare_digest(given.encode(), self._expected):
                error = HttpError(
                    401,
                    "invalid or missing API key (send `Authorization: Bearer <key>`)",
                    code="invalid_api_key",
                )
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
        headers = _ignored(body, "/tokenize")
        with _as_http(headers):
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
        headers = _ignored(body, "/detokenize")
        with _as_http(headers):
            check_model(body.model)
            out = {"prompt": core.detokenize(body.to_detokenize()).text}
        return JSONResponse(out, headers=headers)

    # ---- completions --------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        headers = _ignored(body, "/v1/completions")
        prompt_only = body.prompt_only
        with _as_http(headers, body.field_names):
            lora = check_model(body.model)
            gens = body.to_generates()
            for gen in gens:
                gen.lora_name = lora
            capacity = core.admission.max_running + core.admission.max_queued
            if len(gens) > capacity:
                raise FieldError(
                    "prompt",
                    f"{len(gens)} prompts, more than this gateway admits at once ({capacity}: "
                    "--max-concurrent-requests + --max-queued-requests)",
                )
        logprobs = body.logprobs is not None
        fmt = Formatter(core, "completions", body.include_usage, logprobs, body.continuous_usage)
        fmt.echo = body.echo
        fmt.prompt_only = prompt_only
        fmt.field_names = body.field_names
        return _respond(core, gens, DEFAULT_MAX_TOKENS, body.stream, fmt, headers)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> Response:
        headers = _ignored(body, "/v1/chat/completions")
        with _as_http(headers, body.field_names):
            lora = check_model(body.model)
            gen = body.to_generate(auto_tools)
            gen.lora_name = lora
            calls = body.tool_calls(auto_tools)
        fmt = Formatter(core, "chat", body.include_usage, body.logprobs, body.continuous_usage)
        fmt.tool_calls = calls
        fmt.auto_tools = auto_tools if body.auto_tool_choice() else None
        fmt.tool_names = frozenset(body.tool_names())
        fmt.parallel_tool_calls = body.parallel_tool_calls
        fmt.field_names = body.field_names
        # (A constrained output is all answer: the grammar leaves no room to think.)
        if not gen.sampling_params.HasField("structured_outputs"):
            fmt.reasoning = reasoning
        return _respond(core, [gen], None, body.stream, fmt, headers)

    return app


@contextlib.contextmanager
def _as_http(headers: dict[str, str], names: dict[str, str] | None = None) -> Iterator[None]:
    """A refused request (a bad field in translation, or the core's refusal) as its HTTP
    error, with the response's ``headers``; ``names``: the request's fields by the internal
    names they were translated into (filled in as the translation goes)."""
    try:
        try:
            yield
        except FieldError as exc:
            raise HttpError.of(GenerationError.invalid(exc), names) from None
        except GenerationError as exc:
            raise HttpError.of(exc, names) from None
    except HttpError as exc:
        exc.headers = headers
        raise


def ignored_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """The fields of ``body`` (and of the objects in it) that no field of this server reads,
    as paths (``max_token``, ``messages[0].nmae``); those sent as null are left out (they
    change nothing)."""
    out = [prefix + k for k, v in (body.model_extra or {}).items() if v is not None]
    for name in type(body).model_fields:
        value = getattr(body, name)
        if isinstance(value, BaseModel):
            out += ignored_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    out += ignored_fields(item, f"{prefix}{name}[{i}].")
    return out


def _ignored(body: BaseModel, path: str) -> dict[str, str]:
    """The response headers that name the fields of ``body`` this server ignored (none if
    it read them all); each ignored field is logged too (a warning, as vLLM logs them)."""
    fields = ignored_fields(body)
    if not fields:
        return {}
    named = fields[:_MAX_NAMED]
    log.warning("openai_fields_ignored", path=path, fields=named, count=len(fields))
    # (as printable ASCII: a field's name is the client's text, a header is latin-1)
    value = ", ".join(json.dumps(f)[1:-1] for f in named)
    if len(fields) > len(named):
        value += f", (+{len(fields) - len(named)} more)"
    return {IGNORED_HEADER: value}


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
    return (_EventStream if stream else _Completion)(responses, fmt, headers)


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


class _GenerationResponse(Response):
    """A response that runs its request inside its ASGI call, where the client's ``receive``
    is at hand: the request is cancelled (and aborted on its executor) the moment the client
    disconnects, and the core's generator is closed before the call returns."""

    media_type = "application/json"
    extra_headers: dict[str, str] | None = None

    def __init__(self, responses: Responses, fmt: Formatter, headers: dict[str, str]) -> None:
        # No Response.__init__: there is no body to render yet.
        self.responses = responses
        self.fmt = fmt
        self.status_code = 200
        self.background = None
        self.own_headers = headers  # on the response, whatever it turns out to be
        self.init_headers({**(self.extra_headers or {}), **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with contextlib.aclosing(self.responses):
            await _until_disconnect(receive, self._send(scope, receive, send))

    async def _send(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class _Completion(_GenerationResponse):
    """A whole (non-streaming) completion: one JSON object, or the error's status."""

    async def _send(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await self.fmt.collect(self.responses)
            response: Response = JSONResponse(body, headers=self.own_headers)
        except GenerationError as exc:
            response = self.fmt.error(exc).response(self.own_headers)
        await response(scope, receive, send)


class _EventStream(_GenerationResponse):
    """Server-Sent Events. The headers wait for the first response, so that an error up to
    there (refused, invalid, no executor) is the HTTP status."""

    media_type = "text/event-stream"
    extra_headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}

    async def _send(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            first = await anext(self.responses, None)
        except GenerationError as exc:
            await self.fmt.error(exc).response(self.own_headers)(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async with contextlib.aclosing(self.fmt.events(first, self.responses)) as events:
            async for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnect(receive: Receive, work: Coroutine[Any, Any, None]) -> bool:
    """Run ``work`` (producing a response) until it ends or the client disconnects, whichever
    comes first; True if it ran to its end. On a disconnect ``work`` is cancelled, and the
    cancellation unwinds through the core's generator: the request leaves the gateway's queue,
    or is aborted on its executor. A send to a client that has gone (an ``OSError`` from the
    server) counts as a disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()
        gone.cancel()
        await asyncio.wait((task, gone))  # both unwound before the generator is closed
    if task.cancelled():
        return False
    exc = task.exception()
    if isinstance(exc, OSError):
        return False
    if exc is not None:
        raise exc
    return True


async def _disconnected(receive: Receive) -> None:
    """Return when the client disconnects. The request body has been read by then: the
    server's next message is ``http.disconnect``, sent the moment the connection drops."""
    while (await receive())["type"] != "http.disconnect":
        pass
