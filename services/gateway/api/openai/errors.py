"""Errors of the OpenAI-compatible HTTP front, all in OpenAI's shape ``{"error": {"message",
"type", "param", "code"}}``: the core's refusals, bodies that are not JSON or do not fit the
request's schema, unknown routes and methods, and anything unexpected.

``param`` names a field as the request spelled it: a path like ``messages[0].content``, or
the request's own field where the gateway translated it into another (a ``response_format``
schema is compiled as ``structured_outputs.json``; the error names
``response_format.json_schema.schema``). A body that is not valid JSON has no field to name:
``param`` is null, as OpenAI and vLLM answer, and the message says where the JSON breaks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from services.gateway.core.generation import ErrorKind, GenerationError

log = structlog.get_logger(__name__)

_HTTP_STATUS = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.ALREADY_EXISTS: 400,
    ErrorKind.RESOURCE_EXHAUSTED: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.FAILED_PRECONDITION: 400,
    ErrorKind.PERMISSION_DENIED: 403,
}
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


# Anthropic's error types by status (its Messages API at ANTHROPIC_PATHS answers in its shape).
_ANTHROPIC_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = "/v1/messages"


def anthropic_path(path: str) -> bool:
    """Whether ``path`` is one of Anthropic's routes (whose errors take its shape)."""
    return path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/")


class HttpError(Exception):
    """An HTTP error, in OpenAI's shape or (``anthropic``) in Anthropic's:
    ``{"type": "error", "error": {"type", "message"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers: Mapping[str, str] | None = None  # the response's own (raised as is)
        self.anthropic = False

    @classmethod
    def of(cls, exc: GenerationError, names: Mapping[str, str] | None = None) -> HttpError:
        """The core's error; ``names``: request fields by the internal name the gateway
        translated them into (``structured_outputs.json`` -> ``response_format...``)."""
        param = rename(_param(exc.field), names or {}) if exc.field else None
        message = exc.message
        if exc.field and param and message.startswith(exc.field):
            message = param + message[len(exc.field) :]
        return cls(_HTTP_STATUS[exc.kind], message, param, exc.kind.value)

    def body(self) -> dict[str, Any]:
        if self.anthropic:
            kind = _ANTHROPIC_TYPE.get(self.status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPE.get(self.status, "error"),
                "param": self.param,
                "code": self.code or None,
            }
        }

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _param(field: str) -> str:
    """A core field path as the OpenAI request names it."""
    for prefix, name in (
        ("sampling_params.", ""),
        ("prompt_token_ids.ids", "prompt"),
        ("messages.messages", "messages"),
        ("messages.tools", "tools"),
    ):
        if field.startswith(prefix):
            return name + field[len(prefix) :] if name else field[len(prefix) :]
    return field


def rename(param: str, names: Mapping[str, str]) -> str:
    """``param`` with an internal field at its start replaced by the request's name for it."""
    for internal, external in names.items():
        if param == internal or param.startswith((internal + ".", internal + "[")):
            return external + param[len(internal) :]
    return param


def install(app: FastAPI) -> None:
    """Answer every error of ``app`` in OpenAI's shape (Anthropic's on its routes)."""

    def shaped(request: Request, exc: HttpError) -> HttpError:
        exc.anthropic = exc.anthropic or anthropic_path(request.url.path)
        return exc

    @app.exception_handler(HttpError)
    async def on_http_error(request: Request, exc: HttpError) -> JSONResponse:
        return shaped(request, exc).response(exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return shaped(request, validation_error(exc.errors(), exc.body)).response()

    @app.exception_handler(HTTPException)
    async def on_route_error(request: Request, exc: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"Invalid URL ({where})"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"Method not allowed ({where}); this URL takes {allowed}"
        else:
            message = str(exc.detail)
        return shaped(request, HttpError(exc.status_code, message)).response(exc.headers)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("http_internal_error", path=request.url.path, exc_info=exc)
        error = HttpError(500, "internal server error", code="internal")
        return shaped(request, error).response()


# ---- request bodies that do not fit ---------------------------------------------------------

_JSON_TYPES = {str: "a string", bool: "a boolean", int: "a number", float: "a number"}
# pydantic's names of a union's members in an error's location: str, list[int], ContentPart
_UNION_TAG = re.compile(r"(str|int|float|bool|none|[a-z]+\[.*\]|[A-Z]\w*|[\w-]+\[.*\])")


def json_type(value: Any) -> str:
    """What JSON calls ``value``'s type, with its article ("an array")."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return _JSON_TYPES.get(type(value), type(value).__name__)


def validation_error(errors: Any, body: Any = None) -> HttpError:
    """FastAPI's errors for a body that is not JSON, or does not fit the request's model, as
    one 400 naming the field: the deepest error (the part of the body that got the furthest),
    and for a value that fits none of a union's members, what they are."""
    errors = list(errors)
    if not errors:
        return HttpError(400, "invalid request body", None, "invalid_argument")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return HttpError(400, _not_json(first, body), None, "invalid_argument")
    located = [(_path(e.get("loc", ())), e) for e in errors]
    path, error = max(located, key=lambda pe: len(pe[0]))
    if not path:  # the body itself
        if error.get("type") == "missing":
            message = "the request body is empty: send a JSON object"
        elif isinstance(body, bytes):
            message = "the request body was not read as JSON: send it as application/json"
        else:
            message = f"the request body must be a JSON object, not {json_type(body)}"
        return HttpError(400, message, None, "invalid_argument")
    param = _render(path)
    members = [_union_tag(e) for p, e in located if p == path and len(e.get("loc", ())) > 1]
    if len(members) > 1 and all(members):
        *rest, last = members
        message = f"must be {', '.join(str(m) for m in rest)} or {last}"
        message += f", not {json_type(error.get('input'))}"
    else:
        message = error.get("msg", "invalid")
    return HttpError(400, f"{param}: {message}", param, "invalid_argument")


def _not_json(error: dict[str, Any], body: Any) -> str:
    pos = error.get("loc", ("body", None))[-1]
    why = (error.get("ctx") or {}).get("error", "JSON decode error")
    if isinstance(body, str) and isinstance(pos, int):
        line = body.count("\n", 0, pos) + 1
        column = pos - body.rfind("\n", 0, pos)
        return (
            f"the request body is not valid JSON: {why}: line {line} column {column} (char {pos})"
        )
    return f"the request body is not valid JSON: {why} (char {pos})"


def _path(loc: Any) -> list[str | int]:
    """An error's location in the body, without ``body`` and pydantic's union member tags."""
    parts = list(loc)[1:] if loc and loc[0] == "body" else list(loc)
    return [p for p in parts if isinstance(p, int) or not _UNION_TAG.fullmatch(p)]


def _union_tag(error: dict[str, Any]) -> str | None:
    last = error.get("loc", ())[-1]
    return last if isinstance(last, str) and _UNION_TAG.fullmatch(last) else None


def _render(path: list[str | int]) -> str:
    out = ""
    for p in path:
        if isinstance(p, int) or not p.isidentifier():
            out += f"[{p}]"
        else:
            out += f".{p}" if out else p
    return out
