"""The gateway's HTTP listener: uvicorn serving the OpenAI-compatible app inside the gateway's
own event loop (no signal handlers of its own: the gateway's SIGTERM drain stops it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import structlog
import uvicorn
from fastapi import FastAPI

from services.common.ports import listen_sockets

log = structlog.get_logger(__name__)


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        *,
        drain_timeout_s: float,
        flag: str = "--http-port",
    ) -> None:
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=max(1, int(drain_timeout_s)),
            timeout_keep_alive=30,
        )
        self._server = _EmbeddedServer(config)
        self._host = host
        self._port = port
        self._flag = flag
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Listen and return the port. The sockets are bound here, not by uvicorn: a port
        another process holds raises :class:`~services.common.ports.PortInUseError` naming
        the flag that sets it (``--http-port``)."""
        sockets = listen_sockets(self._host, self._port, self._flag)
        self.port = int(sockets[0].getsockname()[1])
        self._task = asyncio.create_task(self._server.serve(sockets), name="http-server")
        while not self._server.started:
            if self._task.done():  # uvicorn logs why and exits
                with contextlib.suppress(SystemExit):
                    self._task.result()
                raise OSError(f"could not serve HTTP on {self._host}:{self.port}")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        """Stop accepting; open streams get the drain timeout, then are cancelled."""
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
