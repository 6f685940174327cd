"""Bearer-token authentication for every public RPC (health and reflection stay open)."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        given_bytes = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given_bytes, self._expected):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong credentials: send metadata `authorization: Bearer <api key>`",
        )

    async def deny_stream(
        request: object, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        await deny(request, context)
        yield  # pragma: no cover - never reached

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            deny_stream, request_deserializer=handler.request_deserializer
        )
    return grpc.unary_unary_rpc_method_handler(
        deny, request_deserializer=handler.request_deserializer
    )
