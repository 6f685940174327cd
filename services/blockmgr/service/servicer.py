"""Thin grpc.aio servicer over :class:`BlockManagerCore`: pb <-> domain, errors -> status."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog

from pagedserve.v1 import blockmgr_pb2 as pb
from pagedserve.v1 import blockmgr_pb2_grpc as pb_grpc
from services.blockmgr.api import convert, convert_results
from services.blockmgr.api.errors import BlockManagerError, ErrorCode
from services.blockmgr.api.types import EVENTS_LIVE_HEADER, KVEvent
from services.blockmgr.service.core import BlockManagerCore

log = structlog.get_logger(__name__)

_CODE_TO_STATUS = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}

R = TypeVar("R")


def _maps_errors(
    fn: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await fn(self, request, context)
        except BlockManagerError as exc:
            await context.abort(_CODE_TO_STATUS[exc.code], exc.message)
        except Exception:
            log.exception("blockmgr_internal_error", rpc=fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {fn.__name__}")
        raise AssertionError("unreachable")  # context.abort raises

    return wrapper


class BlockManagerServicer(pb_grpc.BlockManagerServicer):
    def __init__(self, core: BlockManagerCore, *, max_queued_event_batches: int = 1024) -> None:
        self.core = core
        self.max_queued_event_batches = max_queued_event_batches

    @_maps_errors
    async def Info(self, request: pb.BlockManagerInfoRequest, context) -> pb.BlockManagerInfo:
        return convert.info_to_pb(self.core.info(request.pool_id))

    @_maps_errors
    async def Register(self, request: pb.RegisterPoolRequest, context) -> pb.RegisterPoolResponse:
        info = self.core.register(
            request.pool_id, convert.spec_from_pb(request), owner_token=request.owner_token
        )
        log.info(
            "pool_registered",
            pool_id=info.pool_id,
            epoch=info.epoch,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            eviction_policy=info.eviction_policy,
            enable_prefix_caching=info.enable_prefix_caching,
            groups=[(g.kind.value, g.sliding_window) for g in info.groups],
            host_blocks=info.host_blocks,
            disk_blocks=info.disk_blocks,
            tier_eviction_policy=info.tier_eviction_policy,
            prefix_hit_margin=info.prefix_hit_margin,
            pin_budget_blocks=info.pin_budget_blocks,
            kv_cache_dtype=info.kv_cache_dtype or None,
        )
        return pb.RegisterPoolResponse(
            pool=convert.pool_info_to_pb(info), owner_token=info.owner_token, lease_s=info.lease_s
        )

    @_maps_errors
    async def Unregister(
        self, request: pb.UnregisterPoolRequest, context
    ) -> pb.UnregisterPoolResponse:
        self.core.unregister(request.pool_id, request.epoch, request.owner_token)
        log.info("pool_unregistered", pool_id=request.pool_id, epoch=request.epoch)
        return pb.UnregisterPoolResponse()

    @_maps_errors
    async def Step(self, request: pb.StepRequest, context) -> pb.StepResponse:
        ops = convert.ops_from_pb(request.ops)
        return convert_results.step_to_pb(
            self.core.step(request.pool_id, request.epoch, ops, request.owner_token)
        )

    @_maps_errors
    async def Restore(self, request: pb.RestoreRequest, context) -> pb.RestoreResponse:
        result = self.core.restore(
            request.pool_id,
            request.epoch,
            convert.restored_from_pb(request.sequences),
            request.owner_token,
        )
        log.info(
            "pool_restored",
            pool_id=request.pool_id,
            num_sequences=result.num_sequences,
            num_stored_blocks=result.num_stored_blocks,
        )
        return convert.restore_to_pb(result)

    @_maps_errors
    async def Stats(self, request: pb.PoolStatsRequest, context) -> pb.PoolStats:
        return convert.stats_to_pb(self.core.stats(request.pool_id))

    async def StreamEvents(
        self, request: pb.StreamEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVEventBatch]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[KVEvent] | None] = asyncio.Queue()
        limit = self.max_queued_event_batches

        def on_events(pool_id: str, events: list[KVEvent]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, events)

        try:
            replay = self.core.subscribe(request.pool_id, on_events, request.start_after_seq)
        except BlockManagerError as exc:
            await context.abort(_CODE_TO_STATUS[exc.code], exc.message)
            return
        try:
            # Headers now: the consumer knows it is subscribed before any event arrives.
            await context.send_initial_metadata(((EVENTS_LIVE_HEADER, "live"),))
            if replay:
                yield convert.events_to_pb(request.pool_id, replay)
            while True:
                if queue.qsize() > limit:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"event consumer too slow ({limit} batches queued); "
                        "reconnect with start_after_seq",
                    )
                events = await queue.get()
                if events is None:
                    return
                yield convert.events_to_pb(request.pool_id, events)
        finally:
            self.core.unsubscribe(request.pool_id, on_events)
