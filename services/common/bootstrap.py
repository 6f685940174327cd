"""One start-up for the three services: logging, the start-up line, the ports checked before
anything is loaded, the run until SIGTERM / SIGINT, and the exit status (0 after a stop, 2 for
a configuration that cannot work, 1 for a crash); and the internal gRPC server the block
manager and the executor share (authentication, malformed requests, message size, health,
reflection, the port bound or one line saying which flag to change).

Each service's ``__main__`` is its config, its secrets, its ``serve`` coroutine and the errors
its start-up raises on a bad configuration: nothing else is repeated."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any, Protocol, TypeVar

import grpc
import structlog
from grpc_health.v1 import health

from services.common.auth import SERVER_OPTIONS, InternalSecurity
from services.common.grpc_server import MalformedRequestInterceptor, add_health_and_reflection
from services.common.logging import FILE_CONFIG_ERRORS, config_error, configure_logging, loggable
from services.common.ports import check_ports

__all__ = ["InternalServer", "run_service"]

MAX_MESSAGE_BYTES = 64 * 2**20  # a Step or a session message of a large batch
# What every start-up raises on a configuration that cannot work: a file that cannot be read,
# a value out of range or a port taken (ConfigError is a ValueError).
CONFIG_ERRORS: tuple[type[Exception], ...] = (*FILE_CONFIG_ERRORS, ValueError)


class _Config(Protocol):
    @property
    def log_level(self) -> str: ...


C = TypeVar("C", bound=_Config)


def run_service(
    name: str,
    config: C,
    serve: Callable[[C], Coroutine[Any, Any, int | None]],
    *,
    secrets: Iterable[str | None] = (),
    ports: Mapping[str, tuple[str, int | None]] | None = None,
    config_errors: tuple[type[Exception], ...] = (),
    crash_event: str | None = None,
) -> int:
    """Run ``serve(config)`` to its end and return the process's exit status.

    ``secrets``: scrubbed from every log line. ``ports``: flag -> (host, port), checked free
    before ``serve`` starts. ``config_errors``: what this service's start-up raises besides
    :data:`CONFIG_ERRORS` on a configuration that cannot work (status 2, one ``config_error``
    line). ``crash_event``: log any other exception under this event with its traceback and
    return 1 (else it propagates)."""
    log = configure_logging(name, config.log_level, secrets=list(secrets))
    log.info(f"{name}_starting", config=loggable(config))
    try:
        if ports:
            check_ports(ports)
        return asyncio.run(serve(config)) or 0
    except (*CONFIG_ERRORS, *config_errors) as exc:
        return config_error(log, exc)
    except Exception:
        if crash_event is None:
            raise
        log.exception(crash_event)
        return 1


class InternalServer:
    """A grpc.aio server of an internal service (the block manager, an executor): the internal
    token / mTLS and malformed-request interceptors, large messages, ``grpc.health.v1`` and
    reflection for ``service_name``, bound to ``host:port`` (``port`` is the bound port; a
    port in use is a :class:`~services.common.ports.PortInUseError` naming ``--port``)."""

    def __init__(self, security: InternalSecurity, service_name: str, host: str, port: int) -> None:
        self.security = security
        self.service_name = service_name
        self.host = host
        self.server = grpc.aio.server(
            interceptors=[*security.interceptors(), MalformedRequestInterceptor()],
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *SERVER_OPTIONS],
        )
        self.health: health.aio.HealthServicer = add_health_and_reflection(
            self.server, service_name
        )
        self._address = f"{host}:{port}"
        self.port = 0

    def bind(self) -> int:
        """Bind once the servicers are added; returns the port."""
        self.port = self.security.add_port(self.server, self._address)
        if self.port == 0:
            raise OSError(f"could not bind {self._address}")
        return self.port

    async def start(self, log: structlog.stdlib.BoundLogger, event: str) -> None:
        """Start serving and log ``event`` with the address; warn when internal RPCs are
        unauthenticated."""
        await self.server.start()
        log.info(event, host=self.host, port=self.port, **self.security.redacted())
        if not self.security.token and not self.security.tls:
            log.warning(
                "internal_rpcs_unauthenticated",
                hint="set --internal-token (or PAGEDSERVE_INTERNAL_TOKEN) on every service",
            )
