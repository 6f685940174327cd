"""The block manager service's core: several pools, their owners and leases, epochs, stats
and KV events.

Ownership: Register hands its caller an owner token; every later Step, Restore, Unregister
and re-Register of that pool must carry it, so no other client can free, grow or replace a
live pool's sequences. A pool whose owner made no call for ``pool_lease_s`` seconds expires:
its blocks are reclaimed and its id is free for a new owner (an executor that died without
unregistering). Bounds on pools and pool sizes keep one client from exhausting the process.

Thread-safe (one lock; every operation is short). No gRPC here: the servicer and the
in-process client both call this class.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from services.blockmgr.api.errors import exhausted, invalid, not_found, precondition
from services.blockmgr.api.hashing import HASH_ALGORITHM, HASH_SIZE
from services.blockmgr.api.types import (
    EvictionPolicyName,
    KVEvent,
    KVEventKind,
    KVMedium,
    Operation,
    PoolInfo,
    PoolSpec,
    PoolStats,
    RestoredSequence,
    RestoreResult,
    ServiceInfo,
    StepResult,
)
from services.blockmgr.eviction.retention import DEFAULT_RETENTION_STEPS, MAX_RETENTION_PRIORITY
from services.blockmgr.pool.groups import MAX_KV_CACHE_GROUPS, split_key, validated_groups
from services.blockmgr.pool.manager import KVBlockManager
from services.blockmgr.trace.record import TraceWriter

log = structlog.get_logger(__name__)

IMPLEMENTATION = "pagedserve-blockmgr"
VERSION = "0.1.0"
MAX_BLOCKS = 2**31 - 1  # block ids travel as int32 in device block tables
DEFAULT_MAX_POOLS = 64
DEFAULT_MAX_POOL_BLOCKS = 2**22  # ~0.25 GB of metadata at most per pool
MAX_BLOCK_SIZE = 4096
MAX_POOL_ID_LEN = 128
MIN_OWNER_TOKEN_LEN, MAX_OWNER_TOKEN_LEN = 16, 128

EventListener = Callable[[str, list[KVEvent]], None]


@dataclass
class _Pool:
    info: PoolInfo
    manager: KVBlockManager
    owner_token: str
    expires_at: float  # clock time; inf without a lease
    num_steps: int = 0


class _EventLog:
    """Per-pool-id event history: bounded replay buffer plus live listeners. Sequence numbers
    keep increasing across re-registrations of the same pool id, and across restarts of this
    process too: they start from the clock (microseconds), so a consumer resuming with the
    last number it saw from before a restart still receives every new event."""

    def __init__(self, capacity: int) -> None:
        self.buffer: deque[KVEvent] = deque(maxlen=capacity)
        self.next_seq = max(1, time.time_ns() // 1000)
        self.listeners: list[EventListener] = []


class BlockManagerCore:
    def __init__(
        self,
        *,
        event_buffer: int = 10000,
        max_pools: int = DEFAULT_MAX_POOLS,
        max_pool_blocks: int = DEFAULT_MAX_POOL_BLOCKS,
        pool_lease_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        trace: TraceWriter | None = None,
        retention_steps: int = DEFAULT_RETENTION_STEPS,
    ) -> None:
        """``pool_lease_s``: seconds a pool lives without a call from its owner (0: no expiry,
        for a block manager living inside its only executor). ``trace``: where every call that
        changes a pool is recorded, for offline replay (:mod:`services.blockmgr.trace.record`)."""
        self.trace = trace
        self.retention_steps = retention_steps
        self._lock = threading.Lock()
        self._pools: dict[str, _Pool] = {}
        self._events: dict[str, _EventLog] = {}
        self._event_buffer = event_buffer
        self._epoch_counter = itertools.count(1)
        self.max_pools = max_pools
        self.max_pool_blocks = min(max_pool_blocks, MAX_BLOCKS)
        self.pool_lease_s = pool_lease_s
        self._clock = clock
        self._next_sweep = 0.0

    # ---- service-level --------------------------------------------------------------------

    def info(self, pool_id: str = "") -> ServiceInfo:
        with self._lock:
            self._sweep()
            if pool_id:
                pools: tuple[PoolInfo, ...] = (self._pool(pool_id).info,)
            else:
                pools = tuple(p.info for p in self._pools.values())
        return ServiceInfo(
            implementation=IMPLEMENTATION,
            version=VERSION,
            hash_algorithm=HASH_ALGORITHM,
            hash_size=HASH_SIZE,
            eviction_policies=tuple(EvictionPolicyName),
            pools=pools,
            max_kv_cache_groups=MAX_KV_CACHE_GROUPS,
            max_retention_priority=MAX_RETENTION_PRIORITY,
        )

    def register(self, pool_id: str, spec: PoolSpec, *, owner_token: str = "") -> PoolInfo:
        """Create a pool, or replace one's own (``owner_token`` from its registration). A new
        epoch is issued; the previous epoch's sequences and cached hashes are dropped and its
        epoch refused from now on. The answer carries the owner token and the lease; a live
        pool of another owner is FAILED_PRECONDITION until its lease expires. A new pool takes
        a proposed ``owner_token`` (16..128 characters) or gets a random one.

        ``spec.groups``: at most :data:`MAX_KV_CACHE_GROUPS`, FULL or SLIDING (see
        :mod:`services.blockmgr.pool.groups`). INVALID_ARGUMENT naming the field otherwise."""
        if not pool_id or len(pool_id) > MAX_POOL_ID_LEN:
            raise invalid(f"pool_id must be 1..{MAX_POOL_ID_LEN} characters")
        spec = self._checked_spec(spec)
        if owner_token and not MIN_OWNER_TOKEN_LEN <= len(owner_token) <= MAX_OWNER_TOKEN_LEN:
            raise invalid(
                f"owner_token must be {MIN_OWNER_TOKEN_LEN}..{MAX_OWNER_TOKEN_LEN} characters"
            )
        with self._lock:
            self._sweep(force=True)
            current = self._pools.get(pool_id)
            if current is not None:
                if not _same_token(owner_token, current.owner_token):
                    raise precondition(
                        f"pool {pool_id!r} is held by another owner; it can be registered "
                        f"again once its lease expires (in "
                        f"{max(current.expires_at - self._clock(), 0):.0f} s) or it is "
                        "unregistered"
                    )
                token = current.owner_token
            else:
                if len(self._pools) >= self.max_pools:
                    raise exhausted(f"at most {self.max_pools} pools (--max-pools)")
                # A new pool takes the owner token its registrant proposes (an executor derives
                # one from a secret, so that it can take its pool back after a restart), or a
                # fresh random one.
                token = owner_token or secrets.token_hex(16)
            manager = KVBlockManager(spec, retention_steps=self.retention_steps, clock=self._clock)
            # Epochs are unique across restarts of this process too (time-based floor), so an
            # executor holding an epoch from before a restart can never be mistaken for current.
            epoch = max(next(self._epoch_counter), time.time_ns() // 1000)
            self._epoch_counter = itertools.count(epoch + 1)
            info = PoolInfo.of(pool_id, epoch, spec)
            self._pools[pool_id] = _Pool(info, manager, token, self._lease_end())
            if self.trace is not None:
                self.trace.register(pool_id, spec, self.retention_steps)
            log = self._events.setdefault(pool_id, _EventLog(self._event_buffer))
            # Every new epoch starts with CLEARED, the first one too: a consumer that knew the
            # pool before a block-manager restart learns that every hash it knew is gone.
            self._publish(pool_id, log, epoch, [(KVEventKind.CLEARED, (), 0, KVMedium.DEVICE)])
        return dataclasses.replace(info, owner_token=token, lease_s=self.pool_lease_s)

    def _checked_spec(self, spec: PoolSpec) -> PoolSpec:
        """``spec`` with its policies parsed and its groups validated; INVALID_ARGUMENT naming
        the field out of range."""
        if not 2 <= spec.num_blocks <= self.max_pool_blocks:
            raise invalid(
                f"num_blocks must be in [2, {self.max_pool_blocks}] (--max-pool-blocks), "
                f"got {spec.num_blocks}"
            )
        if not 1 <= spec.block_size <= MAX_BLOCK_SIZE:
            raise invalid(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {spec.block_size}")
        for name in ("host_blocks", "disk_blocks"):
            value = getattr(spec, name)
            if not 0 <= value <= self.max_pool_blocks:
                raise invalid(
                    f"{name} must be in [0, {self.max_pool_blocks}] (--max-pool-blocks), "
                    f"got {value}"
                )
        if spec.prefix_hit_margin < 0:
            raise invalid(f"prefix_hit_margin must be >= 0, got {spec.prefix_hit_margin}")
        for name in ("kv_cache_dtype", "kv_scales"):
            if len(getattr(spec, name)) > 64:
                raise invalid(f"{name} must be at most 64 characters")
        if not 0 <= spec.pin_budget_blocks <= max(spec.num_blocks - 1, 0):
            raise invalid(
                f"pin_budget_blocks must be in [0, num_blocks - 1], got {spec.pin_budget_blocks}"
            )
        try:
            return dataclasses.replace(
                spec,
                eviction_policy=EvictionPolicyName.parse(spec.eviction_policy),
                tier_eviction_policy=EvictionPolicyName.parse(spec.tier_eviction_policy),
                groups=validated_groups(spec.groups),
            )
        except ValueError as exc:
            raise invalid(str(exc)) from None

    def unregister(self, pool_id: str, epoch: int, owner_token: str = "") -> None:
        """Remove one's own pool (an executor shutting down): its blocks are reclaimed and its
        cached hashes announced as cleared."""
        with self._lock:
            self._checked(pool_id, epoch, owner_token)
            self._remove(pool_id)

    # ---- per-pool -------------------------------------------------------------------------

    def step(
        self, pool_id: str, epoch: int, ops: Sequence[Operation], owner_token: str = ""
    ) -> StepResult:
        """Apply ``ops`` in order (see the proto). An empty Step renews the lease."""
        with self._lock:
            self._sweep()
            pool = self._checked(pool_id, epoch, owner_token)
            manager = pool.manager
            try:
                results = manager.step(ops)
            finally:
                moves = manager.take_moves()
                self._flush_events(pool_id, pool)
            if self.trace is not None:
                self.trace.step(pool_id, ops)
            pool.num_steps += 1
            return StepResult(tuple(results), manager.counters(), *moves)

    def restore(
        self,
        pool_id: str,
        epoch: int,
        sequences: Sequence[RestoredSequence],
        owner_token: str = "",
    ) -> RestoreResult:
        with self._lock:
            pool = self._checked(pool_id, epoch, owner_token)
            try:
                stored = pool.manager.restore(sequences)
            finally:
                self._flush_events(pool_id, pool)
            if self.trace is not None:
                self.trace.restore(pool_id, sequences)
            return RestoreResult(len(sequences), stored, pool.manager.counters())

    def stats(self, pool_id: str) -> PoolStats:
        with self._lock:
            self._sweep()
            pool = self._pool(pool_id)
            m = pool.manager
            host, disk = m.pool.host, m.pool.disk
            return PoolStats(
                pool=pool.info,
                counters=m.counters(),
                prefix_cache_queries_tokens=m.prefix_queries_tokens,
                prefix_cache_hits_tokens=m.prefix_hits_tokens,
                num_evicted_blocks=m.pool.num_evicted,
                num_cow_copies=m.num_cow_copies,
                num_steps=pool.num_steps,
                last_event_seq=self._events[pool_id].next_seq - 1,
                host_hits_tokens=m.host_hits_tokens,
                num_offloaded_blocks=host.num_offloaded if host else 0,
                num_onboarded_blocks=host.num_onboarded if host else 0,
                num_host_evicted_blocks=host.num_evicted if host else 0,
                num_host_cached_blocks=host.occupied() if host else 0,
                eviction_age_steps=m.pool.eviction_age_steps,
                eviction_reuse=m.pool.eviction_reuse,
                num_swapped_out_blocks=host.num_swapped_out if host else 0,
                num_swapped_in_blocks=host.num_swapped_in if host else 0,
                num_swapped_sequences=len(m.swapped),
                disk_hits_tokens=m.disk_hits_tokens,
                num_spilled_blocks=disk.num_offloaded if disk else 0,
                num_loaded_blocks=disk.num_onboarded if disk else 0,
                num_disk_cached_blocks=disk.occupied() if disk else 0,
            )

    def block_table(self, pool_id: str, seq_id: int) -> list[int]:
        """A sequence's current table (debugging and tests; not part of the wire contract)."""
        with self._lock:
            return self._pool(pool_id).manager.block_table(seq_id)

    def manager(self, pool_id: str) -> KVBlockManager:
        """Direct access for invariant checks in tests. Not thread-safe."""
        return self._pool(pool_id).manager

    # ---- events ---------------------------------------------------------------------------

    def subscribe(
        self, pool_id: str, listener: EventListener, start_after_seq: int = 0
    ) -> list[KVEvent]:
        """Register ``listener`` for live events of ``pool_id`` and return the buffered events
        with ``seq > start_after_seq`` (atomically: nothing is missed or duplicated between the
        replay and the first live call). The listener runs under the core's lock: it must only
        enqueue."""
        with self._lock:
            self._pool(pool_id)
            log = self._events[pool_id]
            log.listeners.append(listener)
            return [e for e in log.buffer if e.seq > start_after_seq]

    def unsubscribe(self, pool_id: str, listener: EventListener) -> None:
        with self._lock:
            log = self._events.get(pool_id)
            if log is not None and listener in log.listeners:
                log.listeners.remove(listener)

    # ---- internals ------------------------------------------------------------------------

    def _pool(self, pool_id: str) -> _Pool:
        pool = self._pools.get(pool_id)
        if pool is None:
            raise not_found(f"unknown pool_id {pool_id!r}")
        return pool

    def _checked(self, pool_id: str, epoch: int, owner_token: str) -> _Pool:
        """The pool, if the caller owns it and holds its current epoch; renews the lease."""
        pool = self._pool(pool_id)
        if not _same_token(owner_token, pool.owner_token):
            raise precondition(f"pool {pool_id!r}: missing or wrong owner_token (from Register)")
        if epoch != pool.info.epoch:
            raise precondition(
                f"stale epoch {epoch} for pool {pool_id!r} (current {pool.info.epoch}); "
                "re-register and restore"
            )
        pool.expires_at = self._lease_end()
        return pool

    def _lease_end(self) -> float:
        return self._clock() + self.pool_lease_s if self.pool_lease_s > 0 else float("inf")

    def _sweep(self, *, force: bool = False) -> None:
        """Reclaim every pool whose lease ran out (at most every quarter lease, unless
        ``force``). Caller holds the lock."""
        if self.pool_lease_s <= 0:
            return
        now = self._clock()
        if not force and now < self._next_sweep:
            return
        self._next_sweep = now + self.pool_lease_s / 4
        for pool_id in [pid for pid, p in self._pools.items() if p.expires_at <= now]:
            log.warning("pool_lease_expired", pool_id=pool_id, lease_s=self.pool_lease_s)
            self._remove(pool_id)

    def _remove(self, pool_id: str) -> None:
        pool = self._pools.pop(pool_id)
        if self.trace is not None:
            self.trace.unregister(pool_id)
        self._publish(
            pool_id,
            self._events[pool_id],
            pool.info.epoch,
            [(KVEventKind.CLEARED, (), 0, KVMedium.DEVICE)],
        )
        # Keep the event history of removed pools (a re-registration continues its sequence
        # numbers) but not without bound: forget the idle ones beyond a few per live pool.
        if len(self._events) > 4 * self.max_pools:
            for pid in [
                p for p, ev in self._events.items() if p not in self._pools and not ev.listeners
            ]:
                del self._events[pid]

    def _flush_events(self, pool_id: str, pool: _Pool) -> None:
        grouped: list[tuple[KVEventKind, tuple[bytes, ...], int, KVMedium]] = []
        host, disk = pool.manager.pool.host, pool.manager.pool.disk
        for pending, medium in (
            (pool.manager.pool.events, KVMedium.DEVICE),
            (host.events if host is not None else [], KVMedium.HOST),
            (disk.events if disk is not None else [], KVMedium.DISK),
        ):
            if not pending:
                continue
            run: list[bytes] = []
            kind, group = pending[0][0], split_key(pending[0][1])[1]
            for event_kind, key in pending:
                block_hash, event_group = split_key(key)
                if event_kind != kind or event_group != group:
                    grouped.append((kind, tuple(run), group, medium))
                    run, kind, group = [], event_kind, event_group
                run.append(block_hash)
            grouped.append((kind, tuple(run), group, medium))
            pending.clear()
        if grouped:
            self._publish(pool_id, self._events[pool_id], pool.info.epoch, grouped)

    def _publish(
        self,
        pool_id: str,
        log: _EventLog,
        epoch: int,
        grouped: list[tuple[KVEventKind, tuple[bytes, ...], int, KVMedium]],
    ) -> None:
        events = []
        for kind, hashes, group, medium in grouped:
            events.append(KVEvent(log.next_seq, epoch, kind, hashes, group, medium))
            log.next_seq += 1
        log.buffer.extend(events)
        for listener in list(log.listeners):
            listener(pool_id, events)


def _same_token(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
