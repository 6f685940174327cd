"""The gateway's side of the executors: one multiplexed Session stream per executor.

Each :class:`ExecutorConnection` keeps its executor's Info, its latest load, and one Session
stream over which every request routed to it travels (``add`` / ``abort`` out, one
``ExecutorStep`` per scheduler step in). Per-request updates are fanned out to asyncio queues.
When the stream breaks (the executor died or restarted), every in-flight request fails with
UNAVAILABLE and the connection re-opens in the background. :class:`ExecutorPool` routes new
requests to the ready executor with the fewest in-flight requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from pagedserve.v1 import executor_pb2, executor_pb2_grpc
from services.common.auth import InternalSecurity

log = structlog.get_logger(__name__)

Item = executor_pb2.SequenceUpdate | executor_pb2.RequestError | BaseException


class ExecutorUnavailable(Exception):
    pass


class ExecutorConnection:
    def __init__(
        self,
        address: str,
        *,
        on_change: Callable[[], None] = lambda: None,
        on_step: Callable[[executor_pb2.ExecutorStep], None] = lambda step: None,
        retry_s: float = 0.2,
        security: InternalSecurity | None = None,
    ) -> None:
        security = security or InternalSecurity()
        self.address = address
        self.on_change = on_change
        self.on_step = on_step
        self.retry_s = retry_s
        self.info: executor_pb2.ExecutorInfo | None = None
        self.load: executor_pb2.ExecutorLoad | None = None
        self.ready = False
        self._channel = security.aio_channel(address)
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self._metadata = security.metadata()
        self._outbox: asyncio.Queue[executor_pb2.SessionRequest | None] = asyncio.Queue()
        self._inflight: dict[str, asyncio.Queue[Item]] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"executor-{self.address}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._channel.close()

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, add: executor_pb2.AddRequest) -> asyncio.Queue[Item]:
        """Send ``add``; updates (and a RequestError or exception) arrive on the queue."""
        if not self.ready:
            raise ExecutorUnavailable(f"executor {self.address} is not ready")
        q: asyncio.Queue[Item] = asyncio.Queue()
        self._inflight[add.request_id] = q
        self._outbox.put_nowait(executor_pb2.SessionRequest(add=add))
        return q

    def release(self, request_id: str, *, abort: bool) -> None:
        """Forget a request; with ``abort`` the executor stops it at its next step."""
        if self._inflight.pop(request_id, None) is not None and abort and self.ready:
            self._outbox.put_nowait(
                executor_pb2.SessionRequest(abort=executor_pb2.AbortRequest(request_id=request_id))
            )

    def abort_sample(self, request_id: str, index: int) -> None:
        """Stop one sample of an n > 1 request; the others go on."""
        if request_id in self._inflight and self.ready:
            self._outbox.put_nowait(
                executor_pb2.SessionRequest(
                    abort=executor_pb2.AbortRequest(request_id=request_id, index=index)
                )
            )

    # ---- the connection ---------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                self.info = await self._stub.Info(
                    executor_pb2.ExecutorInfoRequest(), timeout=5, metadata=self._metadata
                )
                await self._session()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                if self.ready or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    log.warning(
                        "executor_stream_lost",
                        address=self.address,
                        code=exc.code().name,
                        details=exc.details(),
                    )
            except Exception:
                log.exception("executor_connection_error", address=self.address)
            self._set_ready(False)
            self._fail_all(ExecutorUnavailable(f"executor {self.address} is unavailable"))
            await asyncio.sleep(self.retry_s)

    async def _session(self) -> None:
        self._outbox = asyncio.Queue()
        outbox = self._outbox

        async def requests() -> AsyncIterator[executor_pb2.SessionRequest]:
            while True:
                item = await outbox.get()
                if item is None:
                    return
                yield item

        call = self._stub.Session(requests(), metadata=self._metadata)
        await call.wait_for_connection()
        self._set_ready(True)
        log.info(
            "executor_connected",
            address=self.address,
            model=self.info.model_name if self.info else None,
        )
        async for step in call:
            self.load = step.load
            self.on_step(step)
            for err in step.errors:
                q = self._inflight.pop(err.request_id, None)
                if q is not None:
                    q.put_nowait(err)
            for update in step.updates:
                q = self._inflight.get(update.request_id)
                if q is not None:
                    q.put_nowait(update)
        raise ExecutorUnavailable(f"executor {self.address} closed the session")

    def _fail_all(self, exc: BaseException) -> None:
        inflight, self._inflight = self._inflight, {}
        for q in inflight.values():
            q.put_nowait(exc)

    def _set_ready(self, ready: bool) -> None:
        if ready != self.ready:
            self.ready = ready
            self.on_change()


class ExecutorPool:
    """Every configured executor; routes each request to the least-loaded ready one."""

    def __init__(
        self,
        addresses: tuple[str, ...],
        *,
        on_change: Callable[[], None] = lambda: None,
        on_step: Callable[[executor_pb2.ExecutorStep], None] = lambda step: None,
        security: InternalSecurity | None = None,
    ) -> None:
        self.connections = [
            ExecutorConnection(a, on_change=on_change, on_step=on_step, security=security)
            for a in addresses
        ]

    def start(self) -> None:
        for c in self.connections:
            c.start()

    async def close(self) -> None:
        for c in self.connections:
            await c.close()

    @property
    def ready(self) -> list[ExecutorConnection]:
        return [c for c in self.connections if c.ready and c.info is not None]

    @property
    def info(self) -> executor_pb2.ExecutorInfo | None:
        ready = self.ready
        return ready[0].info if ready else None

    def pick(self) -> ExecutorConnection:
        ready = self.ready
        if not ready:
            raise ExecutorUnavailable("no executor is ready")
        return min(ready, key=lambda c: c.num_inflight)
