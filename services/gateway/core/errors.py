"""How the generation core fails a request: :class:`GenerationError` with its
:class:`ErrorKind`, which each front (gRPC, the HTTP APIs) maps to its own statuses."""

from __future__ import annotations

import enum

from pagedserve.v1 import executor_pb2
from services.common.limits import FieldError

__all__ = ["NO_EXECUTOR", "REFUSAL_KIND", "ErrorKind", "GenerationError"]

NO_EXECUTOR = (
    "no executor is serving (starting up, restarting, or waiting for its block manager); "
    "retry in a few seconds"
)


class ErrorKind(enum.Enum):
    """Why a request failed; each front maps these to its own statuses."""

    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    ALREADY_EXISTS = "already_exists"
    INTERNAL = "internal"
    NOT_FOUND = "not_found"  # a LoRA adapter no executor serves
    FAILED_PRECONDITION = "failed_precondition"  # an adapter in use, changed, or LoRA off
    PERMISSION_DENIED = "permission_denied"  # runtime adapter updates are off


class GenerationError(Exception):
    def __init__(self, kind: ErrorKind, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.field = field  # the offending request field, for INVALID_ARGUMENT

    @classmethod
    def invalid(cls, exc: FieldError) -> GenerationError:
        return cls(ErrorKind.INVALID_ARGUMENT, str(exc), exc.field)


REFUSAL_KIND = {  # an executor's refusal of a request, as the core reports it
    executor_pb2.REQUEST_ERROR_CODE_INVALID_ARGUMENT: ErrorKind.INVALID_ARGUMENT,
    executor_pb2.REQUEST_ERROR_CODE_ALREADY_EXISTS: ErrorKind.ALREADY_EXISTS,
    executor_pb2.REQUEST_ERROR_CODE_RESOURCE_EXHAUSTED: ErrorKind.RESOURCE_EXHAUSTED,
    executor_pb2.REQUEST_ERROR_CODE_INTERNAL: ErrorKind.INTERNAL,
    executor_pb2.REQUEST_ERROR_CODE_NOT_FOUND: ErrorKind.NOT_FOUND,
    executor_pb2.REQUEST_ERROR_CODE_FAILED_PRECONDITION: ErrorKind.FAILED_PRECONDITION,
}
