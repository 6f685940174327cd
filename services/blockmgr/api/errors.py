"""The block manager's error vocabulary, shared by the core, the servicer and both clients.

The core raises :class:`BlockManagerError` with a :class:`ErrorCode`; the gRPC servicer maps the
code 1:1 onto a gRPC status and the gRPC client maps it back, so callers see the same exception
whichever client they use.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    UNAUTHENTICATED = "UNAUTHENTICATED"  # the server wants the internal token (or mTLS)
    INTERNAL = "INTERNAL"


class BlockManagerError(Exception):
    """A refused request. Nothing was changed by the call that raised it."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


def invalid(message: str) -> BlockManagerError:
    return BlockManagerError(ErrorCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> BlockManagerError:
    return BlockManagerError(ErrorCode.NOT_FOUND, message)


def precondition(message: str) -> BlockManagerError:
    return BlockManagerError(ErrorCode.FAILED_PRECONDITION, message)


def exhausted(message: str) -> BlockManagerError:
    return BlockManagerError(ErrorCode.RESOURCE_EXHAUSTED, message)
