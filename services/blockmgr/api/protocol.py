"""The client protocol: what the executor needs from a block manager, whichever it is
(:class:`services.blockmgr.client.InProcessClient`, :class:`~services.blockmgr.client.GrpcClient`
or any other implementation of the contract)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

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

__all__ = ["BlockManagerClient", "EventStream", "StepCall"]


class EventStream(Protocol):
    """Batches of KV events, in order; iteration ends when the stream is closed."""

    def __iter__(self) -> Iterator[list[KVEvent]]: ...
    def close(self) -> None: ...


class StepCall(Protocol):
    """A Step sent but not yet answered (:meth:`BlockManagerClient.step_async`)."""

    def result(self) -> StepResult:
        """The answer; raises :class:`BlockManagerError` as ``step`` would."""
        ...


class BlockManagerClient(Protocol):
    def info(self, pool_id: str = "") -> ServiceInfo: ...

    def register(self, pool_id: str, spec: PoolSpec, *, owner_token: str | None = None) -> PoolInfo:
        """Create or replace a pool (see the proto's Register). ``owner_token``: the token to
        own it with; by default the one of this client's last registration of it (none: the
        block manager picks)."""
        ...

    def step(self, pool_id: str, epoch: int, ops: Sequence[Operation]) -> StepResult: ...

    def step_async(self, pool_id: str, epoch: int, ops: Sequence[Operation]) -> StepCall:
        """Send a Step and return at once; its answer comes with ``result()``."""
        ...

    def restore(
        self, pool_id: str, epoch: int, sequences: Sequence[RestoredSequence]
    ) -> RestoreResult: ...

    def unregister(self, pool_id: str, epoch: int) -> None: ...

    def stats(self, pool_id: str) -> PoolStats: ...

    def events(self, pool_id: str, start_after_seq: int = 0) -> EventStream: ...

    def close(self) -> None: ...
