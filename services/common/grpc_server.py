"""What every pagedserve gRPC server shares: standard health + reflection, health updates,
the SIGTERM/SIGINT stop event, and INVALID_ARGUMENT for requests that do not parse."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import reflection


def add_health_and_reflection(
    server: grpc.aio.Server, service_name: str, *, enable_reflection: bool = True
) -> health.aio.HealthServicer:
    """Register ``grpc.health.v1`` (and server reflection, ``grpc.reflection.v1`` and
    ``v1alpha``) on ``server``."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if enable_reflection:
        reflection.enable_reflection(server, (service_name, health.SERVICE_NAME))
    return servicer


async def set_serving(
    servicer: health.aio.HealthServicer, service_name: str, serving: bool
) -> None:
    """Report the server ("") and the named service as SERVING or NOT_SERVING."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", service_name):
        await servicer.set(name, status)


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (call from the running event loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Bytes that do not parse as the method's request message (or a string field that is not
    UTF-8) are INVALID_ARGUMENT naming the message type, not UNKNOWN: the handler receives
    raw bytes and parses them here. Put it after the authentication interceptors, so a caller
    without credentials is refused before its request is parsed."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        name = handler_call_details.method.rsplit("/", 1)[-1]

        async def parsed(data: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                return parse(data)
            except DecodeError as exc:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{name}: malformed request: {exc}"
                )

        async def parsed_stream(
            stream: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            async for data in stream:
                yield await parsed(data, context)

        if handler.request_streaming and handler.response_streaming:
            stream_stream = handler.stream_stream

            async def streams(stream: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
                async for response in _relay(
                    stream_stream(parsed_stream(stream, context), context)
                ):
                    yield response

            return grpc.stream_stream_rpc_method_handler(
                streams, response_serializer=handler.response_serializer
            )
        if handler.request_streaming:
            stream_unary = handler.stream_unary

            async def stream_in(stream: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
                return await stream_unary(parsed_stream(stream, context), context)

            return grpc.stream_unary_rpc_method_handler(
                stream_in, response_serializer=handler.response_serializer
            )
        if handler.response_streaming:
            behavior = handler.unary_stream

            async def unary_stream(data: bytes, context: grpc.aio.ServicerContext) -> Any:
                async for response in _relay(behavior(await parsed(data, context), context)):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, response_serializer=handler.response_serializer
            )
        unary = handler.unary_unary

        async def unary_unary(data: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await unary(await parsed(data, context), context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, response_serializer=handler.response_serializer
        )


async def _relay(result: Any) -> AsyncIterator[Any]:
    """The responses of a streaming behavior: an async generator yields them, a coroutine
    writes them itself with ``context.write`` (grpc's health Watch does)."""
    if hasattr(result, "__aiter__"):
        async for response in result:
            yield response
    else:
        await result
