"""structlog JSON logging, configured once per entry point; what a configuration may show in
a log (secrets redacted); and the exit status that says a configuration cannot work."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import structlog

from services.common.auth import API_KEY_ENV, INTERNAL_TOKEN_ENV
from services.common.errors import ConfigError

# Exit status of a service whose configuration cannot work (bad flag, unloadable model, a
# file that is not there, a port another process holds), as argparse exits on a bad flag:
# restarting it cannot help, so a supervisor (``pagedserve serve``) stops instead of
# restarting it.
CONFIG_ERROR_STATUS = 2
# A file named by a flag (model directory, TLS certificate or key) that is not there or cannot
# be read: a configuration error in every service. (Not every OSError: a bind that fails for
# another reason than a port in use, :class:`~services.common.ports.PortInUseError`, stays a
# failure worth a restart.)
FILE_CONFIG_ERRORS: tuple[type[OSError], ...] = (
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)
# Fields whose value is a secret: a log shows whether they are set, never the value.
SECRET_FIELDS = frozenset({"token", "internal_token", "api_key", "password", "secret"})
# The environment variables that may hold a secret of any service.
SECRET_ENV_VARS = (INTERNAL_TOKEN_ENV, API_KEY_ENV)
REDACTED = "***"
# Shorter secrets are not scrubbed from rendered lines: they would match ordinary text (the
# structured redaction of :func:`loggable` still applies to them).
MIN_SCRUBBED_LEN = 8

Scrub = Callable[[str], str]


def configure_logging(
    service: str, level: str = "INFO", secrets: Iterable[str | None] = ()
) -> structlog.stdlib.BoundLogger:
    """Configure structlog to write one JSON object per line to stderr; return the service logger.

    Call once from each entry point (never from library code). Library modules just use
    ``structlog.get_logger(__name__)``. ``secrets`` and the values of
    :data:`SECRET_ENV_VARS` (those of at least :data:`MIN_SCRUBBED_LEN` characters) never
    appear in a line written by structlog or by the standard ``logging`` module (third-party
    libraries), tracebacks included: they are replaced by ``***``, a last line of defence
    behind :func:`loggable`. Raises ``ValueError`` for an unknown ``level``.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    scrub = _scrubber([*secrets, *(os.environ.get(name) for name in SECRET_ENV_VARS)])
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ScrubbingFormatter(scrub))
    logging.basicConfig(handlers=[handler], level=numeric, force=True)

    def add_service(
        _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        event_dict.setdefault("service", service)
        return event_dict

    def scrub_line(_logger: Any, _method: str, line: Any) -> str:
        """After the renderer: ``line`` is the rendered JSON string."""
        return scrub(str(line))

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_service,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
            scrub_line,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write() per line (print() writes the newline separately): processes sharing
        # stderr, such as tensor-parallel ranks, then never interleave inside a line shorter
        # than the pipe's atomic-write size.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger(service)


def loggable(value: object) -> object:
    """A JSON-ready view of a configuration for a log line, with no secret in it.

    A dataclass becomes a dict of its fields; a field named in :data:`SECRET_FIELDS` shows
    ``"***"`` when set and ``None`` when not; an object with a ``redacted()`` method (such as
    :class:`~services.common.auth.InternalSecurity`) shows what that returns; an enum its
    value; tuples, lists and dicts are walked.
    """
    redacted = getattr(value, "redacted", None)
    if callable(redacted):
        return redacted()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _field_view(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)
        }
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [loggable(v) for v in value]
    if isinstance(value, dict):
        return {k: _field_view(str(k), v) for k, v in value.items()}
    return value


def config_error(log: structlog.stdlib.BoundLogger, exc: BaseException) -> int:
    """Log why the configuration cannot work (``config_error`` with its ``reason``, no
    traceback: the message names the flag, file or value; a :class:`ConfigError`'s ``flag``
    and ``details`` too) and return :data:`CONFIG_ERROR_STATUS`, the status the entry point
    exits with."""
    extra: dict[str, object] = {}
    if isinstance(exc, ConfigError):
        extra = {**exc.details, **({"flag": exc.flag} if exc.flag else {})}
    log.error("config_error", reason=str(exc), error=type(exc).__name__, **extra)
    return CONFIG_ERROR_STATUS


def _field_view(name: str, value: object) -> object:
    if name in SECRET_FIELDS:
        return REDACTED if value else None
    return loggable(value)


def _scrubber(secrets: Iterable[str | None]) -> Scrub:
    """A function replacing every secret, raw or as escaped inside a JSON string, by ``***``."""
    forms: set[str] = set()
    for secret in secrets:
        if secret and len(secret) >= MIN_SCRUBBED_LEN:
            forms.update((secret, json.dumps(secret)[1:-1]))
    ordered = sorted(forms, key=len, reverse=True)  # a secret inside another goes last

    def scrub(text: str) -> str:
        for form in ordered:
            if form in text:
                text = text.replace(form, REDACTED)
        return text

    return scrub


class _ScrubbingFormatter(logging.Formatter):
    """The standard library's records as their bare message (tracebacks included), scrubbed."""

    def __init__(self, scrub: Scrub) -> None:
        super().__init__("%(message)s")
        self._scrub = scrub

    def format(self, record: logging.LogRecord) -> str:
        return self._scrub(super().format(record))
