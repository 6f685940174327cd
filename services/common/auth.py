"""Authentication of RPCs: the public API key (gateway) and the internal token and mTLS
between the services (gateway -> executor -> block manager), in one place.

Every internal RPC carries the shared internal token as metadata
(``x-pagedserve-internal-token``); a server started with one refuses calls without it
(UNAUTHENTICATED), so no other local process can drive an executor session or a block-manager
pool. Health stays open everywhere (probes carry no credentials). mTLS is an option on top:
servers then require a client certificate signed by the internal CA.
"""

from __future__ import annotations

import argparse
import hmac
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.common.ports import bind_port

INTERNAL_TOKEN_HEADER = "x-pagedserve-internal-token"
INTERNAL_TOKEN_ENV = "PAGEDSERVE_INTERNAL_TOKEN"
API_KEY_ENV = "PAGEDSERVE_API_KEY"  # the gateway's public API key
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."

# Every channel between the services: reconnect within a second of a dependency coming back
# (gRPC's default back-off grows to two minutes), and keepalives to notice a dead peer.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Prompt log-probabilities come in one message (16k tokens at top-20: ~3.5 MiB).
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
)
# Every server: accept those keepalives, ping idle clients, and never share a port with
# another process (a second instance must fail with "address in use").
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
)


@dataclass(frozen=True)
class InternalSecurity:
    """The internal token and the optional mTLS files of one service. The token is a secret:
    it is not part of the repr (so a config printed by accident does not show it), and logs
    show :meth:`redacted`."""

    token: str | None = field(default=None, repr=False)
    tls_cert: str | None = None  # this service's certificate chain (PEM)
    tls_key: str | None = None  # its private key (PEM)
    tls_ca: str | None = None  # the CA that signs every internal certificate (PEM)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def redacted(self) -> dict[str, object]:
        """What may be logged: whether a token is set, never the token."""
        return {"internal_token": bool(self.token), "mtls": self.tls}

    def validate(self) -> None:
        files = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(files) and not all(files):
            raise ValueError(
                "--internal-tls-cert, --internal-tls-key and --internal-tls-ca go together"
            )
        if self.token is not None and not self.token:
            raise ValueError("--internal-token must not be empty")

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("internal security (between the services)")
        g.add_argument(
            "--internal-token",
            default=os.environ.get(INTERNAL_TOKEN_ENV) or None,
            help=f"shared secret every internal RPC carries (also {INTERNAL_TOKEN_ENV})",
        )
        g.add_argument("--internal-tls-cert", default=None, help="PEM certificate (mTLS)")
        g.add_argument("--internal-tls-key", default=None, help="PEM private key (mTLS)")
        g.add_argument("--internal-tls-ca", default=None, help="PEM CA of the internal certs")

    @classmethod
    def from_namespace(cls, ns: dict[str, object]) -> InternalSecurity:
        """Pop the internal-security values out of parsed arguments."""
        return cls(
            token=ns.pop("internal_token", None),  # type: ignore[arg-type]
            tls_cert=ns.pop("internal_tls_cert", None),  # type: ignore[arg-type]
            tls_key=ns.pop("internal_tls_key", None),  # type: ignore[arg-type]
            tls_ca=ns.pop("internal_tls_ca", None),  # type: ignore[arg-type]
        )

    # ---- the server side ----------------------------------------------------------------

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        if not self.token:
            return []
        return [
            TokenInterceptor(
                INTERNAL_TOKEN_HEADER,
                self.token,
                open_prefixes=(HEALTH_PREFIX,),
                hint=f"internal RPCs need metadata `{INTERNAL_TOKEN_HEADER}`",
            )
        ]

    def add_port(self, server: grpc.aio.Server, address: str, *, flag: str = "--port") -> int:
        """Bind ``server`` to ``address`` (``host:port``) and return the bound port. A port
        another process holds raises :class:`~services.common.ports.PortInUseError` naming
        ``flag``, the flag that sets it."""
        host, _, port = address.rpartition(":")
        if not self.tls:
            return bind_port(lambda: server.add_insecure_port(address), host, int(port), flag)
        assert self.tls_cert and self.tls_key and self.tls_ca
        credentials = grpc.ssl_server_credentials(
            [(_read(self.tls_key), _read(self.tls_cert))],
            root_certificates=_read(self.tls_ca),
            require_client_auth=True,
        )
        return bind_port(
            lambda: server.add_secure_port(address, credentials), host, int(port), flag
        )

    # ---- the client side ----------------------------------------------------------------

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return internal_metadata(self.token)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        assert self.tls_cert and self.tls_key and self.tls_ca
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca),
            private_key=_read(self.tls_key),
            certificate_chain=_read(self.tls_cert),
        )

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        credentials = self.channel_credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


def internal_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return ((INTERNAL_TOKEN_HEADER, token),) if token else None


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every RPC whose metadata ``header`` is not ``expected``,
    except the methods under ``open_prefixes``. The comparison is constant-time."""

    def __init__(
        self, header: str, expected: str, *, open_prefixes: tuple[str, ...], hint: str
    ) -> None:
        self._header = header
        self._expected = expected.encode()
        self._open = open_prefixes
        self._hint = hint

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(self._open):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get(self._header, "")
        given_bytes = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given_bytes, self._expected):
            return handler
        return _refusal(handler, f"missing or wrong credentials: {self._hint}")


def api_key_interceptor(api_key: str) -> TokenInterceptor:
    """The gateway's public API key: ``authorization: Bearer <key>``."""
    return TokenInterceptor(
        "authorization",
        f"Bearer {api_key}",
        open_prefixes=(HEALTH_PREFIX, REFLECTION_PREFIX),
        hint="send metadata `authorization: Bearer <api key>`",
    )


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(
        request: object, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        await deny(request, context)
        yield  # pragma: no cover - never reached

    # No request deserializer: the refusal never parses the body, so a caller without
    # credentials learns nothing from sending malformed bytes (checked before parsing).
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    return grpc.unary_unary_rpc_method_handler(deny)
