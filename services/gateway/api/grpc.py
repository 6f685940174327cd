"""The public gRPC services, ``pagedserve.v1.Generation`` and ``pagedserve.v1.Adapters``: thin
fronts over :class:`GenerationCore` and :class:`AdapterService`, mapping their errors to gRPC
status codes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from services.gateway.core.adapters import AdapterService
from services.gateway.core.embedding import EmbeddingService
from services.gateway.core.generation import ErrorKind, GenerationCore, GenerationError
from services.gateway.fleet.adapters import AdapterSummary

_STATUS = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
}


async def _abort(context: grpc.aio.ServicerContext, exc: GenerationError) -> None:
    await context.abort(_STATUS[exc.kind], exc.message)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, core: GenerationCore) -> None:
        self.core = core
        self.embeddings = EmbeddingService(core)

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

    async def Embed(
        self, request: generation_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.EmbedResponse:
        try:
            return await self.embeddings.embed(request)
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


def _adapter_pb(summary: AdapterSummary) -> generation_pb2.LoraAdapter:
    return generation_pb2.LoraAdapter(
        name=summary.name,
        path=summary.path,
        rank=summary.rank,
        digest=summary.digest,
        num_executors=summary.num_executors,
        num_running=summary.num_running,
    )


class AdaptersServicer(generation_pb2_grpc.AdaptersServicer):
    """``pagedserve.v1.Adapters``: the LoRA adapters of the executors."""

    def __init__(self, adapters: AdapterService) -> None:
        self.adapters = adapters

    async def LoadAdapter(
        self, request: generation_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.LoraAdapter:
        try:
            summary = await self.adapters.load(
                request.lora_name, request.lora_path, request.replace
            )
        except GenerationError as exc:
            await _abort(context, exc)
            raise
        return _adapter_pb(summary)

    async def UnloadAdapter(
        self, request: generation_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.UnloadLoraAdapterResponse:
        try:
            await self.adapters.unload(request.lora_name)
        except GenerationError as exc:
            await _abort(context, exc)
            raise
        return generation_pb2.UnloadLoraAdapterResponse()

    async def ListAdapters(
        self, request: generation_pb2.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ListLoraAdaptersResponse:
        try:
            listing = await self.adapters.listing()
        except GenerationError as exc:
            await _abort(context, exc)
            raise
        return generation_pb2.ListLoraAdaptersResponse(adapters=[_adapter_pb(s) for s in listing])
