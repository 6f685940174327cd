"""A port another process holds is a configuration error naming the port and its flag, at
every kind of listener: the gRPC servers (``InternalSecurity.add_port``), the gateway's HTTP
server, and the checks an entry point makes before starting (services/common/ports.py). The
processes themselves: tests/test_config_errors.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import grpc
import pytest
from fastapi import FastAPI

from services.common.auth import InternalSecurity
from services.common.errors import ConfigError
from services.common.logging import CONFIG_ERROR_STATUS, config_error
from services.common.ports import (
    PortInUseError,
    bind_port,
    check_ports,
    listen_sockets,
    port_in_use,
)
from services.gateway.service.http_server import HttpServer


@contextlib.contextmanager
def _taken_port() -> Iterator[int]:
    """A loopback port this process listens on, as another server would."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_port_in_use_sees_a_listener_and_nothing_else() -> None:
    with _taken_port() as port:
        assert port_in_use("127.0.0.1", port)
        assert port_in_use("0.0.0.0", port)  # the wildcard clashes with it too
    assert not port_in_use("127.0.0.1", port)
    assert not port_in_use("127.0.0.1", 0)
    assert not port_in_use("no-such-host.invalid", 50051)  # not "in use": bind says why


def test_listen_sockets_names_the_port_and_the_flag() -> None:
    with _taken_port() as port, pytest.raises(PortInUseError) as caught:
        listen_sockets("127.0.0.1", port, "--http-port")
    assert str(caught.value) == f"port {port} is in use: choose another with --http-port"
    assert (caught.value.port, caught.value.flag) == (port, "--http-port")
    assert isinstance(caught.value, ValueError)  # every entry point's CONFIG_ERRORS has it
    sockets = listen_sockets("127.0.0.1", 0, "--http-port")
    assert sockets[0].getsockname()[1] > 0
    for sock in sockets:
        sock.close()


def test_check_ports_skips_ports_that_are_off_and_refuses_one_port_for_two_flags() -> None:
    check_ports({"--port": ("127.0.0.1", 0), "--http-port": ("127.0.0.1", None)})
    check_ports({"--metrics-port": ("127.0.0.1", -1)})
    with _taken_port() as port, pytest.raises(PortInUseError, match="--metrics-port"):
        check_ports({"--port": ("127.0.0.1", 0), "--metrics-port": ("127.0.0.1", port)})
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(ConfigError) as caught:
        check_ports({"--port": ("0.0.0.0", port), "--http-port": ("127.0.0.1", port)})
    assert str(caught.value) == (
        f"port {port} is given to both --port and --http-port: choose another with --http-port"
    )
    # Two addresses of this host, neither a wildcard: the same port on both is fine.
    check_ports({"--port": ("127.0.0.1", port), "--blockmgr-port": ("127.0.0.2", port)})


def test_a_grpc_server_on_a_taken_port_raises_port_in_use_naming_its_flag() -> None:
    async def bind(port: int, **flag: str) -> int:
        server = grpc.aio.server()
        try:
            return InternalSecurity().add_port(server, f"127.0.0.1:{port}", **flag)
        finally:
            await server.stop(None)

    with _taken_port() as port:
        with pytest.raises(PortInUseError, match=f"port {port} is in use: .* with --port$"):
            asyncio.run(bind(port))
        with pytest.raises(PortInUseError, match=r"with --executor-port$"):
            asyncio.run(bind(port, flag="--executor-port"))
    assert asyncio.run(bind(0)) > 0


def test_bind_port_tells_a_port_taken_while_binding_from_another_failure() -> None:
    """The port is free when checked and taken by the time gRPC binds it (a race)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    thief = socket.socket()

    def bind_after_the_thief() -> int:
        thief.bind(("127.0.0.1", port))
        thief.listen()
        raise RuntimeError(f"Failed to bind to address 127.0.0.1:{port}")

    try:
        with pytest.raises(PortInUseError, match="--port"):
            bind_port(bind_after_the_thief, "127.0.0.1", port, "--port")
    finally:
        thief.close()
    with pytest.raises(OSError, match="could not bind"):  # not in use: a failure to restart
        bind_port(lambda: 0, "127.0.0.1", port, "--port")


def test_the_http_server_on_a_taken_port_raises_port_in_use() -> None:
    async def start(port: int) -> int:
        server = HttpServer(FastAPI(), "127.0.0.1", port, drain_timeout_s=1)
        try:
            return await server.start()
        finally:
            await server.stop()

    with _taken_port() as port, pytest.raises(PortInUseError, match=r"with --http-port$"):
        asyncio.run(start(port))
    assert asyncio.run(start(0)) > 0


def test_config_error_logs_the_flag_and_the_port() -> None:
    records: list[tuple[str, dict]] = []

    class Log:
        def error(self, event: str, **fields: object) -> None:
            records.append((event, fields))

    assert config_error(Log(), PortInUseError(50052, "--port")) == CONFIG_ERROR_STATUS  # type: ignore[arg-type]
    assert records == [
        (
            "config_error",
            {
                "reason": "port 50052 is in use: choose another with --port",
                "error": "PortInUseError",
                "port": 50052,
                "flag": "--port",
            },
        )
    ]
