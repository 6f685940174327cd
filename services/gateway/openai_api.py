"""The OpenAI-compatible HTTP front of the gateway (FastAPI), over the same core as gRPC.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or
Server-Sent Events ending with ``data: [DONE]``), vLLM's ``POST /tokenize`` and
``POST /detokenize``, ``GET /health`` and ``GET /metrics`` (the gateway's registry).

Errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}`` with 400
(invalid request, ``param`` naming the field), 401 (API key), 404 (unknown model), 429 (at
``--max-concurrent-requests``, or the executor refused it for capacity) and 503 (no executor
serving). An error before the first token is the response's status; one after the stream has
started is sent as a last ``data: {"error": ...}`` event, then ``[DONE]``. A client that
disconnects aborts its request on the executor, as a gRPC cancel does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedserve.v1 import common_pb2, generation_pb2
from services.common.limits import FieldError
from services.gateway.generation import (
    FINISH_NAMES,
    ErrorKind,
    GenerationCore,
    GenerationError,
)
from services.gateway.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeBody,
)
from services.gateway.validation import DEFAULT_MAX_TOKENS

log = structlog.get_logger(__name__)
T = TypeVar("T")

_HTTP_STATUS = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.ALREADY_EXISTS: 400,
    ErrorKind.RESOURCE_EXHAUSTED: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
}
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}
_OPEN_PATHS = ("/health", "/metrics")


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def of(cls, exc: GenerationError) -> HttpError:
        param = _param(exc.field) if exc.field else None
        message = exc.message
        if exc.field and param and message.startswith(exc.field):
            message = param + message[len(exc.field) :]
        return cls(_HTTP_STATUS[exc.kind], message, param, exc.kind.value)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPE.get(self.status, "error"),
                "param": self.param,
                "code": self.code or None,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _param(field: str) -> str:
    """A core field path as the OpenAI request names it."""
    for prefix, name in (
        ("sampling_params.", ""),
        ("prompt_token_ids.ids", "prompt"),
        ("messages.messages", "messages"),
    ):
        if field.startswith(prefix):
            return name + field[len(prefix) :] if name else field[len(prefix) :]
    return field


def build_app(core: GenerationCore, *, api_key: str | None, registry: Any) -> FastAPI:
    app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Callable[..., Awaitable[Response]]):  # type: ignore[no-untyped-def]
        if api_key and request.url.path not in _OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return HttpError(
                    401,
                    "invalid or missing API key (send `Authorization: Bearer <key>`)",
                    code="invalid_api_key",
                ).response()
        return await call_next(request)

    @app.exception_handler(HttpError)
    async def on_http_error(request: Request, exc: HttpError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc.errors()).response()

    def check_model(model: str | None) -> None:
        if model is not None and model != core.model_name:
            raise HttpError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    # ---- models, health, metrics -------------------------------------------------------------

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = core.pool.info
        card: dict[str, Any] = {
            "id": core.model_name,
            "object": "model",
            "created": created,
            "owned_by": "pagedserve",
        }
        if info is not None:
            card["max_model_len"] = info.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if core.pool.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # ---- tokenize / detokenize ---------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> dict[str, Any]:
        check_model(body.model)
        with _as_http():
            resp = await core.tokenize(body.to_tokenize())
        info = core.pool.info
        out: dict[str, Any] = {
            "count": len(resp.token_ids),
            "max_model_len": info.max_model_len if info else None,
            "tokens": list(resp.token_ids),
        }
        if body.return_token_strs:
            out["token_strs"] = list(resp.tokens)
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict[str, Any]:
        check_model(body.model)

        with _as_http():
            return {"prompt": core.detokenize(body.to_detokenize()).text}

    # ---- completions --------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        with _as_http():
            gen = body.to_generate()
        stream = _Formatter(core, "completions", body.include_usage, body.logprobs is not None)
        return await _respond(core, gen, DEFAULT_MAX_TOKENS, body.stream, stream, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        with _as_http():
            gen = body.to_generate()
        stream = _Formatter(core, "chat", body.include_usage, body.logprobs)
        return await _respond(core, gen, None, body.stream, stream, request)

    return app


@contextlib.contextmanager
def _as_http() -> Iterator[None]:
    """A refused request (a bad field in translation, or the core's refusal) as its HTTP
    error."""
    try:
        yield
    except FieldError as exc:
        raise HttpError.of(GenerationError.invalid(exc)) from None
    except GenerationError as exc:
        raise HttpError.of(exc) from None


def _validation_error(errors: Any) -> HttpError:
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg', 'invalid')}" if param else "invalid request body"
    return HttpError(400, message, param, "invalid_argument")


# ---- responses -------------------------------------------------------------------------------


async def _respond(
    core: GenerationCore,
    request: generation_pb2.GenerateRequest,
    default_max_tokens: int | None,
    stream: bool,
    fmt: _Formatter,
    http_request: Request,
) -> Response:
    responses = core.generate(request, default_max_tokens=default_max_tokens)
    if not stream:
        return JSONResponse(await _until_disconnect(http_request, fmt.collect(responses)))
    # The first response before the headers: an error up to there is the HTTP status.
    try:
        with _as_http():
            first = await anext(responses)
    except StopAsyncIteration:
        first = None
    return StreamingResponse(
        fmt.events(first, responses),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it (aborting the request on its executor) if the client goes."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.1)
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        with _as_http():
            return await task
    finally:
        watcher.cancel()


class _Formatter:
    """Turns the core's per-sample responses into OpenAI objects (one request)."""

    def __init__(self, core: GenerationCore, kind: str, include_usage: bool, logprobs: bool):
        self.core = core
        self.kind = kind
        self.include_usage = include_usage
        self.logprobs = logprobs
        prefix = "cmpl" if kind == "completions" else "chatcmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "text_completion" if kind == "completions" else "chat.completion"
        self._offsets: dict[int, int] = {}  # completions logprobs: text offset per choice
        self._usage: dict[int, common_pb2.Usage] = {}

    # -- non-streaming --

    async def collect(self, responses: AsyncIterator[generation_pb2.GenerateResponse]) -> Any:
        texts: dict[int, list[str]] = {}
        logprobs: dict[int, list[common_pb2.TokenLogprob]] = {}
        finish: dict[int, str] = {}
        async for r in responses:
            texts.setdefault(r.index, []).append(r.text)
            logprobs.setdefault(r.index, []).extend(r.logprobs)
            if r.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                finish[r.index] = FINISH_NAMES.get(r.finish_reason, "stop")
                self._usage[r.index] = r.usage
        choices = []
        for i in sorted(texts):
            text = "".join(texts[i])
            lp = self._logprobs(logprobs[i], 0, i) if self.logprobs else None
            if self.kind == "completions":
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish.get(i)}
            else:
                choice = {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": lp,
                    "finish_reason": finish.get(i),
                }
            choices.append(choice)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.core.model_name,
            "choices": choices,
            "usage": self._usage_body(),
        }

    # -- streaming --

    async def events(
        self,
        first: generation_pb2.GenerateResponse | None,
        responses: AsyncIterator[generation_pb2.GenerateResponse],
    ) -> AsyncIterator[bytes]:
        started: set[int] = set()
        try:
            pending = [first] if first is not None else []
            while True:
                for r in pending:
                    for chunk in self._chunks(r, started):
                        yield _sse(chunk)
                try:
                    pending = [await anext(responses)]
                except StopAsyncIteration:
                    break
            if self.include_usage:
                yield _sse(self._chunk([], usage=self._usage_body()))
        except GenerationError as exc:
            yield _sse(HttpError.of(exc).body())
        finally:
            await responses.aclose()  # the client left early: abort on the executor
        yield b"data: [DONE]\n\n"

    def _chunks(self, r: generation_pb2.GenerateResponse, started: set[int]) -> list[dict]:
        final = r.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        if final:
            self._usage[r.index] = r.usage
        finish = FINISH_NAMES.get(r.finish_reason, "stop") if final else None
        offset = self._offsets.get(r.index, 0)
        lp = self._logprobs(list(r.logprobs), offset, r.index) if self.logprobs else None
        self._offsets[r.index] = offset + len(r.text)
        if self.kind == "completions":
            return [
                self._chunk(
                    [{"index": r.index, "text": r.text, "logprobs": lp, "finish_reason": finish}]
                )
            ]
        out = []
        if r.index not in started:
            started.add(r.index)
            out.append(
                self._chunk(
                    [
                        {
                            "index": r.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            )
        if r.text or lp:
            out.append(
                self._chunk(
                    [
                        {
                            "index": r.index,
                            "delta": {"content": r.text},
                            "logprobs": lp,
                            "finish_reason": None,
                        }
                    ]
                )
            )
        if final:
            out.append(
                self._chunk(
                    [{"index": r.index, "delta": {}, "logprobs": None, "finish_reason": finish}]
                )
            )
        return out

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completions" else "chat.completion.chunk"
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.core.model_name,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = usage
        return chunk

    # -- shared --

    def _usage_body(self) -> dict[str, Any]:
        prompt = next(iter(self._usage.values())).prompt_tokens if self._usage else 0
        cached = next(iter(self._usage.values())).cached_prompt_tokens if self._usage else 0
        completion = sum(u.completion_tokens for u in self._usage.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _logprobs(
        self, logprobs: list[common_pb2.TokenLogprob], offset: int, index: int
    ) -> dict[str, Any] | None:
        decode = self.core.tokenizer.decode
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": (t := decode([lp.token_id])),
                        "logprob": lp.logprob,
                        "bytes": list(t.encode()),
                        "top_logprobs": [
                            {
                                "token": (a := decode([top.token_id])),
                                "logprob": top.logprob,
                                "bytes": list(a.encode()),
                            }
                            for top in lp.top_logprobs
                        ],
                    }
                    for lp in logprobs
                ]
            }
        tokens = [decode([lp.token_id]) for lp in logprobs]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [
                {decode([top.token_id]): top.logprob for top in lp.top_logprobs} for lp in logprobs
            ],
            "text_offset": offsets,
        }


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
