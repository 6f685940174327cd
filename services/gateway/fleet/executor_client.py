"""The gateway's side of the executors: one multiplexed Session stream per executor.

Each :class:`ExecutorConnection` keeps its executor's Info, its latest load, and one Session
stream over which every request routed to it travels (``add`` / ``abort`` out, one
``ExecutorStep`` per scheduler step in). Per-request updates are fanned out to asyncio queues,
tagged with the request id. When the stream breaks (the executor died or restarted), every
in-flight request gets an :class:`ExecutorUnavailable` (the gateway resumes it elsewhere, see
``resume``) and the connection re-opens in the background.

A connection is *ready* while its Session is up and the executor's own health says SERVING
(watched with ``grpc.health.v1``): an executor whose block manager is down reports
NOT_SERVING, gets no new requests, and the requests it holds wait ``executor_wait_s`` for it
to serve again before they fail with UNAVAILABLE. :class:`ExecutorPool` routes each new
request to a ready executor with its :class:`Router` (see ``routing``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import executor_pb2, executor_pb2_grpc
from services.common.auth import InternalSecurity
from services.common.lora import lora_salt
from services.gateway.fleet.routing import Candidate, Decision, Router, RoutingPolicy

log = structlog.get_logger(__name__)

Item = executor_pb2.SequenceUpdate | executor_pb2.RequestError | BaseException
Tagged = tuple[str, Item]  # (the executor-side request id, what came for it)


class ExecutorUnavailable(Exception):
    """No executor for a request. For one lost mid-stream: ``reason`` (``executor_lost``: its
    stream broke; ``executor_not_serving``: it did not serve for ``--executor-wait-s``) and
    ``since``, when (``time.monotonic()``) the request's executor stopped serving it."""

    def __init__(self, message: str, *, reason: str = "", since: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.since = time.monotonic() if since is None else since


class ExecutorConnection:
    def __init__(
        self,
        address: str,
        *,
        on_change: Callable[[], None] = lambda: None,
        on_step: Callable[[executor_pb2.ExecutorStep], None] = lambda step: None,
        retry_s: float = 0.2,
        executor_wait_s: float = 30.0,
        security: InternalSecurity | None = None,
    ) -> None:
        security = security or InternalSecurity()
        self.executor_wait_s = executor_wait_s
        self.address = address
        self.on_change = on_change
        self.on_step = on_step
        self.retry_s = retry_s
        self.info: executor_pb2.ExecutorInfo | None = None
        self.load: executor_pb2.ExecutorLoad | None = None
        # The LoRA adapters it serves, by name (read when it connects; kept by fleet.adapters).
        self.adapters: dict[str, executor_pb2.AdapterInfo] = {}
        self.ready = False
        self.draining = False  # gone from discovery: no new requests, closed once idle
        self.not_ready_since: float | None = time.monotonic()
        self._connected = False  # the Session stream is up
        self._serving = False  # the executor's health says SERVING
        self._expiry: asyncio.TimerHandle | None = None
        self._channel = security.aio_channel(address)
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = security.metadata()
        self._outbox: asyncio.Queue[executor_pb2.SessionRequest | None] = asyncio.Queue()
        self._inflight: dict[str, asyncio.Queue[Tagged]] = {}
        self._tokens: dict[str, int] = {}  # request -> prompt + streamed tokens
        self.inflight_tokens = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def load_tokens(self) -> int:
        """Running + waiting tokens there: the larger of what the executor last reported
        (every gateway's requests, a step old) and this gateway's own (fresh)."""
        reported = self.load.num_running_tokens + self.load.num_waiting_tokens if self.load else 0
        return max(reported, self.inflight_tokens)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"executor-{self.address}")
        self._watch_task = asyncio.create_task(self._watch(), name=f"health-{self.address}")

    async def close(self) -> None:
        for task in (self._task, getattr(self, "_watch_task", None)):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._channel.close()

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, add: executor_pb2.AddRequest, queue: asyncio.Queue[Tagged]) -> None:
        """Send ``add``; its updates (and a RequestError or exception) arrive on ``queue``,
        tagged with ``add.request_id`` (several requests may share one queue)."""
        if not self.ready:
            raise ExecutorUnavailable(f"executor {self.address} is not ready")
        self._inflight[add.request_id] = queue
        self._count(add.request_id, len(add.prompt_token_ids) + len(add.resume.output_token_ids))
        self._outbox.put_nowait(executor_pb2.SessionRequest(add=add))

    def release(self, request_id: str, *, abort: bool) -> None:
        """Forget a request; with ``abort`` the executor stops it at its next step."""
        self._uncount(request_id)
        if self._inflight.pop(request_id, None) is not None and abort and self._connected:
            self._outbox.put_nowait(
                executor_pb2.SessionRequest(abort=executor_pb2.AbortRequest(request_id=request_id))
            )

    def abort_sample(self, request_id: str, index: int) -> None:
        """Stop one sample of an n > 1 request; the others go on."""
        if request_id in self._inflight and self._connected:
            self._outbox.put_nowait(
                executor_pb2.SessionRequest(
                    abort=executor_pb2.AbortRequest(request_id=request_id, index=index)
                )
            )

    async def list_adapters(self) -> dict[str, executor_pb2.AdapterInfo]:
        """The adapters the executor serves (none from one that predates them)."""
        try:
            listing = await self.adapter_stub.ListAdapters(
                executor_pb2.ListAdaptersRequest(), timeout=5, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            return {}
        return {a.name: a for a in listing.adapters}

    @property
    def adapter_stub(self) -> executor_pb2_grpc.ExecutorStub:
        """The stub for the adapter RPCs (they carry :attr:`metadata`)."""
        return self._stub

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return self._metadata

    # ---- the connection ---------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                self.info = await self._stub.Info(
                    executor_pb2.ExecutorInfoRequest(), timeout=5, metadata=self._metadata
                )
                self.adapters = await self.list_adapters()
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
            self._connected = False
            self._update()
            self._fail_all(
                ExecutorUnavailable(
                    f"executor {self.address} is unavailable",
                    reason="executor_lost",
                    since=self.not_ready_since,  # (it may have stopped serving before)
                )
            )
            await asyncio.sleep(self.retry_s)

    async def _watch(self) -> None:
        """Follow the executor's health; a broken watch counts as not serving."""
        request = health_pb2.HealthCheckRequest(service="pagedserve.v1.Executor")
        while True:
            try:
                async for resp in self._health.Watch(request, metadata=self._metadata):
                    self._serving = resp.status == health_pb2.HealthCheckResponse.SERVING
                    self._update()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError:
                pass
            self._serving = False
            self._update()
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
        self._connected = True
        self._update()
        log.info(
            "executor_connected",
            address=self.address,
            model=self.info.model_name if self.info else None,
        )
        async for step in call:
            self.load = step.load
            self.on_step(step)
            for err in step.errors:
                self._uncount(err.request_id)
                q = self._inflight.pop(err.request_id, None)
                if q is not None:
                    q.put_nowait((err.request_id, err))
            for update in step.updates:
                q = self._inflight.get(update.request_id)
                if q is not None:
                    self._count(update.request_id, len(update.token_ids))
                    q.put_nowait((update.request_id, update))
        raise ExecutorUnavailable(f"executor {self.address} closed the session")

    def _count(self, request_id: str, num_tokens: int) -> None:
        self._tokens[request_id] = self._tokens.get(request_id, 0) + num_tokens
        self.inflight_tokens += num_tokens

    def _uncount(self, request_id: str) -> None:
        self.inflight_tokens -= self._tokens.pop(request_id, 0)

    def _fail_all(self, exc: BaseException) -> None:
        inflight, self._inflight = self._inflight, {}
        self._tokens.clear()
        self.inflight_tokens = 0
        for request_id, q in inflight.items():
            q.put_nowait((request_id, exc))

    def _update(self) -> None:
        ready = self._connected and self._serving
        if ready == self.ready:
            return
        self.ready = ready
        if ready:
            self.not_ready_since = None
            if self._expiry is not None:
                self._expiry.cancel()
                self._expiry = None
        else:
            self.not_ready_since = time.monotonic()
            log.warning(
                "executor_not_serving", address=self.address, waiting_s=self.executor_wait_s
            )
            self._expiry = asyncio.get_running_loop().call_later(
                self.executor_wait_s, self._give_up_waiting
            )
        self.on_change()

    def _give_up_waiting(self) -> None:
        """The executor has not served for ``executor_wait_s``: its requests fail now (and are
        aborted there, should it come back)."""
        self._expiry = None
        inflight = list(self._inflight)
        self._fail_all(
            ExecutorUnavailable(
                f"executor {self.address} has not been serving for "
                f"{self.executor_wait_s:g} s (--executor-wait-s)",
                reason="executor_not_serving",
                since=self.not_ready_since,
            )
        )
        if self._connected:
            for request_id in inflight:
                abort = executor_pb2.AbortRequest(request_id=request_id)
                self._outbox.put_nowait(executor_pb2.SessionRequest(abort=abort))


Resolver = Callable[[str, int], Awaitable[set[str]]]


async def resolve_all(host: str, port: int) -> set[str]:
    """Every address ``host`` resolves to, as ``ip:port`` (``[ip]:port`` for IPv6): a
    Kubernetes headless Service names one address per ready pod."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return {
        f"[{info[4][0]}]:{port}" if info[0] == socket.AF_INET6 else f"{info[4][0]}:{port}"
        for info in infos
    }


class ExecutorPool:
    """Every executor: the configured ones, plus those a DNS name resolves to (re-resolved
    every ``dns_interval_s``: executors that appear are connected, those that disappear are
    drained, so no stream is dropped). Routes each request to a ready one with ``router``
    (least-loaded by default)."""

    def __init__(
        self,
        addresses: tuple[str, ...],
        *,
        on_change: Callable[[], None] = lambda: None,
        on_step: Callable[[executor_pb2.ExecutorStep], None] = lambda step: None,
        security: InternalSecurity | None = None,
        executor_wait_s: float = 30.0,
        dns: str | None = None,
        dns_interval_s: float = 5.0,
        resolver: Resolver = resolve_all,
        router: Router | None = None,
    ) -> None:
        self.router = router or Router(RoutingPolicy.LEAST_LOADED)
        self._change = asyncio.Event()  # set (and replaced) whenever an executor changes
        self._make = functools.partial(
            ExecutorConnection,
            on_change=self._changed,
            on_step=on_step,
            security=security,
            executor_wait_s=executor_wait_s,
        )
        self._on_change = on_change
        self._static = set(addresses)
        self._by_address: dict[str, ExecutorConnection] = {a: self._make(a) for a in addresses}
        self._dns = dns
        self._dns_interval_s = dns_interval_s
        self._resolver = resolver
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False

    @property
    def connections(self) -> list[ExecutorConnection]:
        return list(self._by_address.values())

    def start(self) -> None:
        self._started = True
        for c in self._by_address.values():
            c.start()
        if self._dns is not None:
            self._spawn(self._discover(), "executor-discovery")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for c in list(self._by_address.values()):
            await c.close()

    @property
    def ready(self) -> list[ExecutorConnection]:
        return [
            c
            for c in self._by_address.values()
            if c.ready and not c.draining and c.info is not None
        ]

    @property
    def info(self) -> executor_pb2.ExecutorInfo | None:
        ready = self.ready
        return ready[0].info if ready else None

    def _changed(self) -> None:
        self._on_change()
        change, self._change = self._change, asyncio.Event()
        change.set()

    async def wait_ready(
        self, timeout: float, accept: Callable[[ExecutorConnection], bool] | None = None
    ) -> bool:
        """Whether an executor (that ``accept`` takes) is ready, or becomes ready within
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not any(accept is None or accept(c) for c in self.ready):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._change.wait(), left)
        return True

    def pick(
        self,
        prompt_ids: Sequence[int] = (),
        cache_salt: bytes = b"",
        accept: Callable[[ExecutorConnection], bool] | None = None,
        lora_name: str = "",
    ) -> tuple[ExecutorConnection, Decision]:
        """The executor for a prompt (among those ``accept`` takes, and that serve LoRA
        adapter ``lora_name`` if given), and why (see ``routing``)."""
        ready = [
            c
            for c in self.ready
            if (accept is None or accept(c)) and (not lora_name or lora_name in c.adapters)
        ]
        if not ready:
            raise ExecutorUnavailable(
                "no executor is serving (starting up, restarting, or waiting for its block "
                "manager); retry in a few seconds"
            )
        candidates = [
            Candidate(
                key=c.address,
                pool_id=c.info.pool_id if c.info else "",
                block_size=c.info.block_size if c.info else 1,
                prefix_caching=bool(c.info and c.info.enable_prefix_caching and c.info.pool_id),
                load_tokens=c.load_tokens,
                salt=lora_salt(cache_salt, c.adapters[lora_name].digest) if lora_name else None,
            )
            for c in ready
        ]
        decision = self.router.choose(candidates, prompt_ids, cache_salt)
        return ready[decision.index], decision

    def pool_ids(self) -> set[str]:
        """Block-manager pools of the executors (connected at least once) that cache
        prefixes."""
        return {
            c.info.pool_id
            for c in self._by_address.values()
            if c.info is not None and c.info.pool_id and c.info.enable_prefix_caching
        }

    # ---- discovery --------------------------------------------------------------------------

    async def _discover(self) -> None:
        assert self._dns is not None
        host, _, port = self._dns.rpartition(":")
        while True:
            try:
                found = await self._resolver(host, int(port))
            except OSError as exc:  # unresolvable for now (no pod ready yet): keep what we have
                log.warning("executor_dns_failed", name=self._dns, error=str(exc))
            else:
                self.reconcile(found)
            await asyncio.sleep(self._dns_interval_s)

    def reconcile(self, discovered: set[str]) -> None:
        """Connect executors that appeared; drain those that disappeared (no new requests;
        closed once their streams are done). Configured addresses always stay."""
        for address in sorted(discovered - self._by_address.keys()):
            conn = self._make(address)
            self._by_address[address] = conn
            if self._started:
                conn.start()
            log.info("executor_discovered", address=address)
        for address, conn in list(self._by_address.items()):
            gone = address not in discovered and address not in self._static
            if gone and not conn.draining:
                conn.draining = True
                log.info("executor_draining", address=address, inflight=conn.num_inflight)
                self._spawn(self._retire(address, conn), f"drain-{address}")
            elif not gone and conn.draining:  # it came back before it was closed
                conn.draining = False
        self._changed()

    async def _retire(self, address: str, conn: ExecutorConnection) -> None:
        while conn.num_inflight and conn.draining:
            await asyncio.sleep(0.2)
        if conn.draining:
            del self._by_address[address]
            await conn.close()
            log.info("executor_removed", address=address)
            self._changed()

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
