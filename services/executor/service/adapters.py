"""The executor's adapter RPCs (``LoadAdapter``, ``UnloadAdapter``, ``ListAdapters``): a mixin
of :class:`~.servicer.ExecutorServicer`. An adapter is read and checked on a worker thread;
only its registration runs on the engine thread, between two steps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc

from pagedserve.v1 import executor_pb2
from services.executor.core.engine import Engine
from services.executor.core.lora import AdapterVersion, LoRARegistry, check_lora_name
from services.executor.core.outputs import EngineError, RequestErrorCode
from services.executor.service.commands import Call
from services.executor.service.engine_loop import EngineLoop

__all__ = ["STATUS_OF", "AdapterRpcs"]

#: An engine refusal's gRPC status.
STATUS_OF = {code: getattr(grpc.StatusCode, code.value) for code in RequestErrorCode}


def adapter_info(version: AdapterVersion) -> executor_pb2.AdapterInfo:
    return executor_pb2.AdapterInfo(
        name=version.name,
        path=version.path,
        digest=version.digest,
        rank=version.rank,
        num_running=version.num_requests,
    )


class AdapterRpcs:
    loop_: EngineLoop | None

    async def _on_engine(
        self, fn: Callable[[Engine], Any], context: grpc.aio.ServicerContext
    ) -> Any:
        """``fn(engine)`` on the engine thread; an :class:`EngineError` aborts the call with
        its status and message."""
        engine_loop = self.loop_
        if engine_loop is None or not engine_loop.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is not running")
        assert engine_loop is not None
        future: Future[Any] = Future()
        engine_loop.submit(Call(fn, future))
        try:
            return await asyncio.wrap_future(future)
        except EngineError as exc:
            await context.abort(STATUS_OF[exc.code], exc.message)

    def _registry(self) -> LoRARegistry | None:
        engine_loop = self.loop_
        return None if engine_loop is None else engine_loop.engine.adapters

    async def LoadAdapter(
        self, request: executor_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.AdapterInfo:
        registry = self._registry()
        if registry is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is not running")
        assert registry is not None
        try:  # (FAILED_PRECONDITION from read_checked without --enable-lora)
            check_lora_name(request.name, "name")
            if not request.path:
                raise EngineError(RequestErrorCode.INVALID_ARGUMENT, "path: is required")
            # Read and checked here, off the engine thread (the steps go on meanwhile).
            adapter = await asyncio.to_thread(registry.read_checked, request.path)
        except EngineError as exc:
            await context.abort(STATUS_OF[exc.code], exc.message)

        def load(engine: Engine) -> executor_pb2.AdapterInfo:
            version = engine.adapters.load(
                request.name, request.path, replace=request.replace, adapter=adapter
            )
            return adapter_info(version)

        return await self._on_engine(load, context)

    async def UnloadAdapter(
        self, request: executor_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.UnloadAdapterResponse:
        await self._on_engine(lambda engine: engine.adapters.unload(request.name), context)
        return executor_pb2.UnloadAdapterResponse()

    async def ListAdapters(
        self, request: executor_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ListAdaptersResponse:
        def listing(engine: Engine) -> executor_pb2.ListAdaptersResponse:
            registry = engine.adapters
            slots = registry.slots
            return executor_pb2.ListAdaptersResponse(
                enabled=registry.enabled,
                max_loras=registry.max_loras,
                max_lora_rank=slots.max_rank if slots is not None else 0,
                adapters=[adapter_info(v) for v in registry.names.values()],
            )

        return await self._on_engine(listing, context)
