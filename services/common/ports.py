"""The ports a service listens on. A port another process holds is a configuration error
(:class:`PortInUseError`, exit status 2): restarting cannot free it, so the service says which
port and which flag sets it, in one line, and stops at once.

Every listener goes through here: the gRPC servers bind with :func:`bind_port` (through
:meth:`~services.common.auth.InternalSecurity.add_port`), the gateway's HTTP server listens on
:func:`listen_sockets`, and an entry point that starts several listeners checks their ports
first with :func:`check_ports` (``pagedserve serve``, the gateway: before loading anything).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Mapping

from services.common.errors import ConfigError


class PortInUseError(ConfigError):
    """``port`` is held by another process: choose another with ``flag``."""

    def __init__(self, port: int, flag: str) -> None:
        super().__init__(f"port {port} is in use: choose another with {flag}", flag=flag, port=port)
        self.port = port


def _addresses(host: str, port: int) -> list[tuple[int, tuple]]:
    """(family, sockaddr) of each address ``host:port`` binds, as asyncio's ``create_server``
    resolves them (``""``: every interface; an IPv6 address may come in brackets)."""
    infos = socket.getaddrinfo(
        host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    seen: dict[tuple[int, tuple], None] = {}
    for family, _type, _proto, _name, sockaddr in infos:
        seen.setdefault((family, sockaddr), None)
    return list(seen)


def listen_sockets(host: str, port: int, flag: str) -> list[socket.socket]:
    """Sockets bound to ``host:port`` (port 0: a free one), for a server to listen on, as
    asyncio's ``create_server`` binds them (``SO_REUSEADDR``, IPv6-only IPv6 sockets, an
    address family the host lacks skipped). Raises :class:`PortInUseError` naming ``flag``
    when another process holds the port, ``OSError`` when the bind fails otherwise."""
    sockets: list[socket.socket] = []
    try:
        addresses = _addresses(host, port)
        for family, sockaddr in addresses:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL and len(addresses) > 1:
                    sockets.pop().close()  # e.g. "localhost" on a host without IPv6
                    continue
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUseError(port, flag) from exc
                raise
        if not sockets:
            raise OSError(errno.EADDRNOTAVAIL, f"no address to bind for {host}:{port}")
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def port_in_use(host: str, port: int) -> bool:
    """Whether another process holds ``host:port`` (listens on it, or bound it without
    ``SO_REUSEADDR``), so that binding it as a server does fails. Port 0 never is."""
    if not port:
        return False
    try:
        sockets = listen_sockets(host, port, "")
    except PortInUseError:
        return True
    except OSError:  # not resolvable, not an address of this host: not "in use"
        return False
    for sock in sockets:
        sock.close()
    return False


def check_ports(ports: Mapping[str, tuple[str, int | None]]) -> None:
    """Check before starting: ``ports`` maps each flag that sets a port to the host and port
    it binds (a port of ``None``, 0 or below, off or any free port, is skipped). Raises
    :class:`PortInUseError` for the first port another process holds, :class:`ConfigError`
    when two flags name the same port on the same (or a wildcard) address."""
    given: list[tuple[str, str, int]] = []
    for flag, (host, port) in ports.items():
        if port is None or port <= 0:
            continue
        for other, other_host, other_port in given:
            if port == other_port and _overlap(host, other_host):
                raise ConfigError(
                    f"port {port} is given to both {other} and {flag}: choose another with {flag}",
                    flag=flag,
                    port=port,
                )
        given.append((flag, host, port))
        if port_in_use(host, port):
            raise PortInUseError(port, flag)


def _overlap(a: str, b: str) -> bool:
    """Whether listening on hosts ``a`` and ``b`` on one port would clash."""
    wildcards = {"", "0.0.0.0", "::", "[::]"}
    return a == b or a in wildcards or b in wildcards


def bind_port(bind: Callable[[], int], host: str, port: int, flag: str) -> int:
    """Run ``bind`` (a gRPC server's ``add_insecure_port`` / ``add_secure_port`` of
    ``host:port``) and return the port it bound. Another process holding the port raises
    :class:`PortInUseError` naming ``flag``: checked first (gRPC would log its own lines about
    the failed bind), and again when the bind fails (grpcio raises ``RuntimeError``, older
    versions return 0); a bind that fails otherwise raises ``OSError``."""
    address = f"{host}:{port}"
    if port_in_use(host, port):
        raise PortInUseError(port, flag)
    try:
        bound = bind()
    except RuntimeError as exc:
        if port_in_use(host, port):
            raise PortInUseError(port, flag) from exc
        raise OSError(f"could not bind {address}: {exc}") from exc
    if bound == 0:
        if port_in_use(host, port):
            raise PortInUseError(port, flag)
        raise OSError(f"could not bind {address}")
    return bound
