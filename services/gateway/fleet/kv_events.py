"""Following the block manager's KV events of every executor pool into a :class:`PrefixIndex`.

One ``StreamEvents`` stream per pool, resumed from the last sequence number applied (so a
dropped stream, a too-slow consumer or a block-manager restart loses nothing the block
manager still buffers; the index handles the rest: see ``prefix_index``). A pool is *synced*
while its stream is up: once the block manager has sent its headers, which ours does right
after subscribing, or with the first batch for a server that sends none earlier. While a
stream is down the pool is unsynced and the stream is retried with back-off: the pool's
executor may not have (re-)registered yet (NOT_FOUND), or the block manager is down.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import structlog

from pagedserve.v1 import blockmgr_pb2, blockmgr_pb2_grpc
from services.blockmgr.api.convert import events_from_pb
from services.blockmgr.api.types import EVENTS_LIVE_HEADER
from services.common.auth import InternalSecurity
from services.gateway.fleet.prefix_index import PrefixIndex

log = structlog.get_logger(__name__)


class KVEventFollower:
    def __init__(
        self,
        address: str,
        index: PrefixIndex,
        *,
        security: InternalSecurity | None = None,
        retry_s: float = 0.2,
        max_retry_s: float = 2.0,
    ) -> None:
        security = security or InternalSecurity()
        self.address = address
        self.index = index
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self._channel = security.aio_channel(address)
        self._stub = blockmgr_pb2_grpc.BlockManagerStub(self._channel)
        self._metadata = security.metadata()
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def pool_ids(self) -> set[str]:
        return set(self._tasks)

    def track(self, pool_ids: set[str]) -> None:
        """Follow exactly these pools: start streams for new ones, stop (and forget) the
        others."""
        for pool_id in pool_ids - self._tasks.keys():
            self._tasks[pool_id] = asyncio.create_task(
                self._follow(pool_id), name=f"kv-events-{pool_id}"
            )
        for pool_id in self._tasks.keys() - pool_ids:
            self._tasks.pop(pool_id).cancel()
            self.index.forget(pool_id)

    async def close(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._channel.close()

    async def _follow(self, pool_id: str) -> None:
        delay = self.retry_s
        while True:
            start_after = self.index.last_seq(pool_id)
            call = self._stub.StreamEvents(
                blockmgr_pb2.StreamEventsRequest(pool_id=pool_id, start_after_seq=start_after),
                metadata=self._metadata,
            )
            try:
                headers = await call.initial_metadata()
                if headers is not None and any(k == EVENTS_LIVE_HEADER for k, _ in headers):
                    self._synced(pool_id, start_after)
                async for batch in call:
                    self.index.apply(pool_id, events_from_pb(batch))
                    if not self.index.is_synced(pool_id):
                        self._synced(pool_id, start_after)
                    delay = self.retry_s
                code, details = grpc.StatusCode.OK, "the block manager ended the stream"
            except asyncio.CancelledError:
                call.cancel()
                raise
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details()
            was_synced = self.index.is_synced(pool_id)
            self.index.set_synced(pool_id, False)
            if was_synced:
                log.warning("kv_events_lost", pool_id=pool_id, code=code.name, details=details)
                delay = self.retry_s
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # we fell behind: resume at once
                continue
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.max_retry_s)

    def _synced(self, pool_id: str, start_after: int) -> None:
        self.index.set_synced(pool_id, True)
        log.info("kv_events_following", pool_id=pool_id, start_after_seq=start_after)
