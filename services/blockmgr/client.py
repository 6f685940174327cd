"""Two implementations of the client protocol (:mod:`services.blockmgr.api.protocol`).

:class:`InProcessClient` calls a :class:`BlockManagerCore` directly (no serialization);
:class:`GrpcClient` talks to any implementation of ``pagedserve.v1.BlockManager``. Both raise
:class:`BlockManagerError` with the same codes for the same input, which the conformance suite
checks.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import grpc

from pagedserve.v1 import blockmgr_pb2 as pb
from pagedserve.v1 import blockmgr_pb2_grpc as pb_grpc
from services.blockmgr.api import convert, convert_results
from services.blockmgr.api.errors import BlockManagerError, ErrorCode
from services.blockmgr.api.protocol import EventStream, StepCall
from services.blockmgr.api.types import (
    KVEvent,
    Operation,
    PoolInfo,
    PoolSpec,
    PoolStats,
    RestoredSequence,
    RestoreResult,
    ServiceInfo,
    StepResult,
)
from services.blockmgr.service.core import BlockManagerCore
from services.common.auth import CHANNEL_OPTIONS, internal_metadata

# ---- in-process ----------------------------------------------------------------------------


class _QueueEventStream:
    _CLOSED = object()

    def __init__(self, core: BlockManagerCore, pool_id: str, start_after_seq: int) -> None:
        self._core = core
        self._pool_id = pool_id
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._error: BlockManagerError | None = None
        try:
            replay = core.subscribe(pool_id, self._on_events, start_after_seq)
        except BlockManagerError as exc:  # raised on iteration, as the gRPC stream does
            self._error = exc
            return
        if replay:
            self._queue.put(replay)

    def _on_events(self, pool_id: str, events: list[KVEvent]) -> None:
        self._queue.put(events)

    def __iter__(self) -> Iterator[list[KVEvent]]:
        if self._error is not None:
            raise self._error
        while True:
            item = self._queue.get()
            if item is self._CLOSED:
                return
            yield item  # type: ignore[misc]

    def close(self) -> None:
        self._core.unsubscribe(self._pool_id, self._on_events)
        self._queue.put(self._CLOSED)


class _DeferredStep:
    def __init__(self, call: Callable[[], StepResult]) -> None:
        self._call = call

    def result(self) -> StepResult:
        return self._call()


class InProcessClient:
    """Direct calls into a core living in this process."""

    def __init__(self, core: BlockManagerCore | None = None) -> None:
        self.core = core if core is not None else BlockManagerCore()
        self._tokens: dict[str, str] = {}  # pool id -> owner token of our registration

    def info(self, pool_id: str = "") -> ServiceInfo:
        return self.core.info(pool_id)

    def register(self, pool_id: str, spec: PoolSpec, *, owner_token: str | None = None) -> PoolInfo:
        """``owner_token``: the token to own the pool with; by default the one of our last
        registration of it (none: the block manager picks)."""
        token = owner_token or self._tokens.get(pool_id, "")
        info = self.core.register(pool_id, spec, owner_token=token)
        self._tokens[pool_id] = info.owner_token
        return info

    def step(self, pool_id: str, epoch: int, ops: Sequence[Operation]) -> StepResult:
        return self.core.step(pool_id, epoch, ops, self._tokens.get(pool_id, ""))

    def step_async(self, pool_id: str, epoch: int, ops: Sequence[Operation]) -> StepCall:
        """Deferred: the core runs the Step when ``result()`` is called. In one process there
        is no I/O to overlap, and the core's Python work cannot run beside the engine's (the
        GIL); asked for after a GPU forward was launched, it overlaps the device's work."""
        return _DeferredStep(lambda: self.step(pool_id, epoch, ops))

    def restore(
        self, pool_id: str, epoch: int, sequences: Sequence[RestoredSequence]
    ) -> RestoreResult:
        return self.core.restore(pool_id, epoch, sequences, self._tokens.get(pool_id, ""))

    def unregister(self, pool_id: str, epoch: int) -> None:
        self.core.unregister(pool_id, epoch, self._tokens.get(pool_id, ""))
        self._tokens.pop(pool_id, None)

    def stats(self, pool_id: str) -> PoolStats:
        return self.core.stats(pool_id)

    def events(self, pool_id: str, start_after_seq: int = 0) -> EventStream:
        return _QueueEventStream(self.core, pool_id, start_after_seq)

    def close(self) -> None:
        pass


# ---- gRPC ----------------------------------------------------------------------------------

_STATUS_TO_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: ErrorCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: ErrorCode.UNAVAILABLE,
    grpc.StatusCode.UNAUTHENTICATED: ErrorCode.UNAUTHENTICATED,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED: ErrorCode.UNAVAILABLE,
}


def _error(exc: grpc.RpcError) -> BlockManagerError:
    status = exc.code()  # type: ignore[attr-defined]
    code = _STATUS_TO_CODE.get(status, ErrorCode.INTERNAL)
    return BlockManagerError(code, f"{exc.details()} [{status.name}]")  # type: ignore[attr-defined]


class _GrpcEventStream:
    def __init__(self, call: grpc.Future) -> None:
        self._call = call
        self._closed = threading.Event()

    def __iter__(self) -> Iterator[list[KVEvent]]:
        try:
            for batch in self._call:  # type: ignore[attr-defined]
                yield convert.events_from_pb(batch)
        except grpc.RpcError as exc:
            if self._closed.is_set() and exc.code() == grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                return
            raise _error(exc) from None

    def close(self) -> None:
        self._closed.set()
        self._call.cancel()


class _GrpcStepCall:
    def __init__(self, future: grpc.Future) -> None:
        self._future = future

    def result(self) -> StepResult:
        try:
            return convert_results.step_from_pb(self._future.result())
        except grpc.RpcError as exc:
            raise _error(exc) from None


class GrpcClient:
    """Client of any ``pagedserve.v1.BlockManager`` server. Thread-safe (one channel)."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 10.0,
        internal_token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """``internal_token``: sent with every call (metadata ``x-pagedserve-internal-token``)
        to a server that requires it; ``credentials``: TLS (mTLS with a client certificate)."""
        self.address = address
        self.timeout_s = timeout_s
        options = [("grpc.max_receive_message_length", 64 * 1024 * 1024), *CHANNEL_OPTIONS]
        self._channel = (
            grpc.secure_channel(address, credentials, options=options)
            if credentials is not None
            else grpc.insecure_channel(address, options=options)
        )
        self._stub = pb_grpc.BlockManagerStub(self._channel)
        self._metadata = internal_metadata(internal_token)
        self._tokens: dict[str, str] = {}  # pool id -> owner token of our registration

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def info(self, pool_id: str = "") -> ServiceInfo:
        resp = self._call(self._stub.Info, pb.BlockManagerInfoRequest(pool_id=pool_id))
        return convert.info_from_pb(resp)

    def register(self, pool_id: str, spec: PoolSpec, *, owner_token: str | None = None) -> PoolInfo:
        token = owner_token or self._tokens.get(pool_id, "")
        resp = self._call(self._stub.Register, convert.register_to_pb(pool_id, spec, token))
        self._tokens[pool_id] = resp.owner_token
        return dataclasses.replace(
            convert.pool_info_from_pb(resp.pool), owner_token=resp.owner_token, lease_s=resp.lease_s
        )

    def _step_request(self, pool_id: str, epoch: int, ops: Sequence[Operation]) -> pb.StepRequest:
        return pb.StepRequest(
            pool_id=pool_id,
            epoch=epoch,
            ops=convert.ops_to_pb(ops),
            owner_token=self._tokens.get(pool_id, ""),
        )

    def step(self, pool_id: str, epoch: int, ops: Sequence[Operation]) -> StepResult:
        request = self._step_request(pool_id, epoch, ops)
        return convert_results.step_from_pb(self._call(self._stub.Step, request))

    def step_async(self, pool_id: str, epoch: int, ops: Sequence[Operation]) -> StepCall:
        """The request is serialized here; the round trip runs in gRPC's own threads, without
        the GIL, until ``result()`` waits for the answer and converts it."""
        request = self._step_request(pool_id, epoch, ops)
        future = self._stub.Step.future(request, timeout=self.timeout_s, metadata=self._metadata)
        return _GrpcStepCall(future)

    def restore(
        self, pool_id: str, epoch: int, sequences: Sequence[RestoredSequence]
    ) -> RestoreResult:
        request = pb.RestoreRequest(
            pool_id=pool_id,
            epoch=epoch,
            sequences=convert.restored_to_pb(sequences),
            owner_token=self._tokens.get(pool_id, ""),
        )
        return convert.restore_from_pb(self._call(self._stub.Restore, request))

    def unregister(self, pool_id: str, epoch: int) -> None:
        request = pb.UnregisterPoolRequest(
            pool_id=pool_id, epoch=epoch, owner_token=self._tokens.get(pool_id, "")
        )
        self._call(self._stub.Unregister, request)
        self._tokens.pop(pool_id, None)

    def stats(self, pool_id: str) -> PoolStats:
        resp = self._call(self._stub.Stats, pb.PoolStatsRequest(pool_id=pool_id))
        return convert.stats_from_pb(resp)

    def events(self, pool_id: str, start_after_seq: int = 0) -> EventStream:
        call = self._stub.StreamEvents(
            pb.StreamEventsRequest(pool_id=pool_id, start_after_seq=start_after_seq),
            metadata=self._metadata,
        )
        return _GrpcEventStream(call)

    def close(self) -> None:
        self._channel.close()
