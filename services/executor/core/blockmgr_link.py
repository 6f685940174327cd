"""The executor's link to its block-manager pool: registration, the per-step round trip, and
recovery, with one back-off loop for every call.

An unreachable block manager is retried with exponential back-off while the link reports
itself unhealthy. A block manager that lost the pool (restart) or disagrees with us gets a
fresh registration and the pre-step state of every live sequence restored, then the same step
is sent again. No token is lost either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import structlog

from services.blockmgr.api.errors import BlockManagerError, ErrorCode
from services.blockmgr.api.protocol import BlockManagerClient, StepCall
from services.blockmgr.api.types import (
    Operation,
    PoolCounters,
    PoolInfo,
    PoolSpec,
    RestoredSequence,
    StepResult,
)

log = structlog.get_logger(__name__)

MAX_CONSECUTIVE_RESYNCS = 8
# Errors after which the pool is rebuilt from the executor's state and the Step sent again;
# any other is a bug or a misconfiguration, and raised.
RECOVERABLE = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.NOT_FOUND, ErrorCode.FAILED_PRECONDITION})
T = TypeVar("T")


class BlockManagerLink:
    """Owns the pool id and epoch; single-threaded like the engine that drives it.

    ``spec``: the pool this executor registers, fixed for the process's life. ``owner_token``:
    a stable one lets a restarted executor take its pool back. Calls the block manager refuses
    as unavailable are retried after ``retry_s``, doubling up to ``max_backoff_s`` (serving
    again within a second of the block manager coming back)."""

    def __init__(
        self,
        client: BlockManagerClient,
        pool_id: str,
        spec: PoolSpec,
        *,
        owner_token: str | None = None,
        retry_s: float = 0.05,
        max_backoff_s: float = 0.5,
        on_health: Callable[[bool], None] | None = None,
    ) -> None:
        self.client = client
        self.pool_id = pool_id
        self.spec = spec
        self.owner_token = owner_token
        self.retry_s = retry_s
        self.max_backoff_s = max_backoff_s
        self.on_health = on_health or (lambda healthy: None)
        self.healthy = True
        self.num_round_trips = 0
        self.num_recoveries = 0
        self._backoff_s = retry_s
        self._stale = False  # the pool may not match our state: resync before the next Step
        self.pool: PoolInfo = self._with_backoff(self._register, held_ok=True)
        self._last_call = time.monotonic()

    @property
    def epoch(self) -> int:
        return self.pool.epoch

    def counters(self) -> PoolCounters:
        return self._with_backoff(lambda: self.client.stats(self.pool_id).counters)

    def step(
        self, ops: Sequence[Operation], pre_state: Callable[[], list[RestoredSequence]]
    ) -> StepResult:
        """One Step round trip of ``ops``, surviving outages and restarts.

        After a failed call the outcome is unknown (the Step may have been applied and only
        the answer lost), so it is never simply resent: once the block manager answers again,
        the pool is re-registered and restored to ``pre_state()`` (every live sequence as it
        was before ``ops``), then ``ops`` is sent. The cached free blocks may be lost that
        way, never a live sequence."""
        needs_resync, self._stale = self._stale, False
        resyncs = 0
        while True:
            try:
                if needs_resync:
                    self._resync(pre_state())
                    needs_resync = False
                self.num_round_trips += 1
                self._last_call = time.monotonic()
                result = self.client.step(self.pool_id, self.pool.epoch, ops)
            except BlockManagerError as exc:
                if exc.code is ErrorCode.UNAVAILABLE:
                    self._back_off(exc)
                    needs_resync = True
                    continue
                if exc.code in RECOVERABLE and resyncs < MAX_CONSECUTIVE_RESYNCS:
                    log.warning("blockmgr_diverged", error=exc.message)
                    resyncs += 1
                    needs_resync = True
                    continue
                raise
            self._recovered()
            return result

    @property
    def can_send_ahead(self) -> bool:
        """Whether :meth:`send_ahead` may be used: the block manager answers and our pool is
        in step with it (no resync is due)."""
        return self.healthy and not self._stale

    def send_ahead(self, ops: Sequence[Operation]) -> StepCall:
        """Send one Step and return at once; nothing else (no retry, no resync). No other
        call may use the link until its ``result()`` is taken. On any error there the outcome
        is unknown (the Step may have been applied): the caller must :meth:`invalidate` and
        plan again, so that the next :meth:`step` rebuilds the pool (an error not in
        ``RECOVERABLE`` is raised there, as :meth:`step` raises it)."""
        self.num_round_trips += 1
        self._last_call = time.monotonic()
        return self.client.step_async(self.pool_id, self.pool.epoch, ops)

    def invalidate(self) -> None:
        """The last answer could not be trusted: rebuild the pool from our own state (register
        again and restore) before the next Step."""
        self._stale = True

    def keepalive(self, ops_factory: Callable[[], list[RestoredSequence]]) -> None:
        """While idle, renew the pool's lease (an empty Step) once a third of it has passed;
        this also notices a block manager that restarted, and restores it."""
        lease = self.pool.lease_s
        if lease > 0 and time.monotonic() - self._last_call > lease / 3:
            self.step([], ops_factory)

    def unregister(self) -> None:
        """Give the pool back (graceful shutdown); a block manager already gone is fine."""
        try:
            self.client.unregister(self.pool_id, self.pool.epoch)
            log.info("pool_unregistered", pool_id=self.pool_id)
        except BlockManagerError as exc:
            log.warning("pool_unregister_failed", error=exc.message)

    def close(self) -> None:
        self.client.close()

    # ---- internals ------------------------------------------------------------------------

    def _register(self) -> PoolInfo:
        return self.client.register(self.pool_id, self.spec, owner_token=self.owner_token)

    def _resync(self, state: list[RestoredSequence]) -> None:
        """Register again and restore every live sequence to ``state``. A block manager that
        no longer serves the pool's KV-cache groups (replaced by one that ignores them) is an
        error saying so: our tables could not be restored."""
        pool = self._with_backoff(self._register, held_ok=True)
        if self.spec.groups and tuple(pool.groups) != tuple(self.spec.groups):
            raise BlockManagerError(  # not recoverable by another resync
                ErrorCode.INVALID_ARGUMENT,
                f"the block manager re-registered the pool with KV-cache groups "
                f"{[g.kind.value for g in pool.groups]}, not the "
                f"{[g.kind.value for g in self.spec.groups]} it was registered with",
            )
        self.pool = pool
        self.client.restore(self.pool_id, self.pool.epoch, state)
        self.num_recoveries += 1
        log.info("blockmgr_restored", epoch=self.pool.epoch, num_sequences=len(state))

    def _with_backoff(self, call: Callable[[], T], *, held_ok: bool = False) -> T:
        """``call()`` (an idempotent call) until it does not fail with UNAVAILABLE, or, with
        ``held_ok``, with FAILED_PRECONDITION either: our pool id is still held by a previous
        owner (this executor before a restart) until its lease expires."""
        while True:
            try:
                result = call()
            except BlockManagerError as exc:
                retry = exc.code is ErrorCode.UNAVAILABLE or (
                    held_ok and exc.code is ErrorCode.FAILED_PRECONDITION
                )
                if not retry:
                    raise
                self._back_off(exc)
                continue
            self._recovered()
            return result

    def _back_off(self, exc: BlockManagerError) -> None:
        """The one retry delay: unhealthy, then wait, doubling up to ``max_backoff_s``."""
        self._set_health(False)
        log.warning("blockmgr_unavailable", error=exc.message, retry_in_s=self._backoff_s)
        time.sleep(self._backoff_s)
        self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)

    def _recovered(self) -> None:
        self._backoff_s = self.retry_s
        self._set_health(True)

    def _set_health(self, healthy: bool) -> None:
        if healthy != self.healthy:
            self.healthy = healthy
            self.on_health(healthy)
