"""structlog JSON logging, configured once per entry point."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, level: str = "INFO") -> structlog.stdlib.BoundLogger:
    """Configure structlog to write one JSON object per line to stderr; return the service logger.

    Call once from each entry point (never from library code). Library modules just use
    ``structlog.get_logger(__name__)``.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=numeric, force=True)

    def add_service(_logger: object, _method: str, event_dict: dict) -> dict:
        event_dict.setdefault("service", service)
        return event_dict

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_service,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write() per line (print() writes the newline separately): processes sharing
        # stderr, such as tensor-parallel ranks, then never interleave inside a line shorter
        # than the pipe's atomic-write size.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger(service)
