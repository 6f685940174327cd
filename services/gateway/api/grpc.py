"""The public ``pagedserve.v1.Generation`` gRPC service: a thin front over
:class:`GenerationCore`, mapping its errors to gRPC status codes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from services.gateway.core.generation import ErrorKind, GenerationCore, GenerationError

_STATUS = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


async def _abort(context: grpc.aio.ServicerContext, exc: GenerationError) -> None:
    await context.abort(_STATUS[exc.kind], exc.message)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, core: GenerationCore) -> None:
        self.core = core

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            # Closed as soon as the call ends (cancelled, deadline): aborted on the executor.
            async with contextlib.aclosing(self.core.generate(request)) as responses:
                async for response in responses:
                    yield response
        except GenerationError as exc:
            await _abort(context, exc)

    async def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.TokenizeResponse:
        try:
            return await self.core.tokenize(request)
        except GenerationError as exc:
            await _abort(context, exc)
            raise

    async def Detokenize(
        self, request: generation_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.DetokenizeResponse:
        try:
            return self.core.detokenize(request)
        except GenerationError as exc:
            await _abort(context, exc)
            raise

    async def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfo:
        try:
            return self.core.model_info()
        except GenerationError as exc:
            await _abort(context, exc)
            raise
