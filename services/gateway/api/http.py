"""What the HTTP fronts (OpenAI's routes, Anthropic's) share: the responses that run a
generation inside their ASGI call (aborting it the moment the client disconnects), a refused
request as its HTTP error, and the naming of the fields a body sent that nothing reads.

A response formats through its API's formatter (:class:`ResponseFormatter`): the OpenAI
front's ``Formatter`` or the Anthropic front's ``MessagesFormatter``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Iterator
from typing import Any, Protocol

import structlog
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from pagedserve.v1 import generation_pb2
from services.common.limits import FieldError
from services.gateway.api.openai.errors import HttpError
from services.gateway.core.generation import GenerationError

__all__ = [
    "IGNORED_HEADER",
    "Completion",
    "EventStream",
    "GenerationResponse",
    "ResponseFormatter",
    "as_http",
    "ignored_fields",
    "ignored_headers",
    "until_disconnect",
]

log = structlog.get_logger(__name__)
Responses = AsyncGenerator[generation_pb2.GenerateResponse, None]

IGNORED_HEADER = "x-pagedserve-ignored-fields"
_MAX_NAMED = 32  # ignored fields named in the header and the log


class ResponseFormatter(Protocol):
    """An API's formatting of one request's responses."""

    def error(self, exc: GenerationError) -> HttpError: ...

    async def collect(self, responses: AsyncIterator[generation_pb2.GenerateResponse]) -> Any: ...

    def events(
        self,
        first: generation_pb2.GenerateResponse | None,
        responses: AsyncIterator[generation_pb2.GenerateResponse],
    ) -> AsyncGenerator[bytes, None]: ...


@contextlib.contextmanager
def as_http(headers: dict[str, str], names: dict[str, str] | None = None) -> Iterator[None]:
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


def ignored_headers(body: BaseModel, path: str, fields: list[str] | None = None) -> dict[str, str]:
    """The response headers that name the fields of ``body`` this server ignored (none if
    it read them all); each ignored field is logged too (a warning, as vLLM logs them)."""
    fields = ignored_fields(body) if fields is None else fields
    if not fields:
        return {}
    named = fields[:_MAX_NAMED]
    log.warning("openai_fields_ignored", path=path, fields=named, count=len(fields))
    # (as printable ASCII: a field's name is the client's text, a header is latin-1)
    value = ", ".join(json.dumps(f)[1:-1] for f in named)
    if len(fields) > len(named):
        value += f", (+{len(fields) - len(named)} more)"
    return {IGNORED_HEADER: value}


class GenerationResponse(Response):
    """A response that runs its request inside its ASGI call, where the client's ``receive``
    is at hand: the request is cancelled (and aborted on its executor) the moment the client
    disconnects, and the core's generator is closed before the call returns."""

    media_type = "application/json"
    extra_headers: dict[str, str] | None = None

    def __init__(
        self, responses: Responses, fmt: ResponseFormatter, headers: dict[str, str]
    ) -> None:
        # No Response.__init__: there is no body to render yet.
        self.responses = responses
        self.fmt = fmt
        self.status_code = 200
        self.background = None
        self.own_headers = headers  # on the response, whatever it turns out to be
        self.init_headers({**(self.extra_headers or {}), **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with contextlib.aclosing(self.responses):
            await until_disconnect(receive, self._send(scope, receive, send))

    async def _send(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class Completion(GenerationResponse):
    """A whole (non-streaming) completion: one JSON object, or the error's status."""

    async def _send(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await self.fmt.collect(self.responses)
            response: Response = JSONResponse(body, headers=self.own_headers)
        except GenerationError as exc:
            response = self.fmt.error(exc).response(self.own_headers)
        await response(scope, receive, send)


class EventStream(GenerationResponse):
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


async def until_disconnect(receive: Receive, work: Coroutine[Any, Any, None]) -> bool:
    """Run ``work`` (producing a response) until it ends or the client disconnects, whichever
    comes first; True if it ran to its end. On a disconnect ``work`` is cancelled, and the
    cancellation unwinds through the core's generator: the request leaves the gateway's queue,
    or is aborted on its executor. A send to a client that has gone (an ``OSError`` from the
    server) counts as a disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(receive))
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


async def disconnected(receive: Receive) -> None:
    """Return when the client disconnects. The request body has been read by then: the
    server's next message is ``http.disconnect``, sent the moment the connection drops."""
    while (await receive())["type"] != "http.disconnect":
        pass
