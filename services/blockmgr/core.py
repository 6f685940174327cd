"""The block manager service's core: several pools, their epochs, stats and KV events.

Thread-safe (one lock; every operation is short). No gRPC here: the servicer and the
in-process client both call this class.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.blockmgr.errors import invalid, not_found, precondition
from services.blockmgr.eviction import POLICIES
from services.blockmgr.hashing import HASH_ALGORITHM, HASH_SIZE
from services.blockmgr.kv_manager import KVBlockManager
from services.blockmgr.types import (
    KVEvent,
    KVEventKind,
    Operation,
    PoolInfo,
    PoolStats,
    RestoredSequence,
    RestoreResult,
    ServiceInfo,
    StepResult,
)

IMPLEMENTATION = "pagedserve-blockmgr"
VERSION = "0.1.0"
MAX_BLOCKS = 2**31 - 1  # block ids travel as int32 in device block tables
MAX_BLOCK_SIZE = 4096
MAX_POOL_ID_LEN = 128

EventListener = Callable[[str, list[KVEvent]], None]


@dataclass
class _Pool:
    info: PoolInfo
    manager: KVBlockManager
    num_steps: int = 0


class _EventLog:
    """Per-pool-id event history: bounded replay buffer plus live listeners. Sequence numbers
    keep increasing across re-registrations of the same pool id."""

    def __init__(self, capacity: int) -> None:
        self.buffer: deque[KVEvent] = deque(maxlen=capacity)
        self.next_seq = 1
        self.listeners: list[EventListener] = []


class BlockManagerCore:
    def __init__(self, *, event_buffer: int = 10000) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str, _Pool] = {}
        self._events: dict[str, _EventLog] = {}
        self._event_buffer = event_buffer
        self._epoch_counter = itertools.count(1)

    # ---- service-level --------------------------------------------------------------------

    def info(self, pool_id: str = "") -> ServiceInfo:
        with self._lock:
            if pool_id:
                pools: tuple[PoolInfo, ...] = (self._pool(pool_id).info,)
            else:
                pools = tuple(p.info for p in self._pools.values())
        return ServiceInfo(
            implementation=IMPLEMENTATION,
            version=VERSION,
            hash_algorithm=HASH_ALGORITHM,
            hash_size=HASH_SIZE,
            eviction_policies=tuple(POLICIES),
            pools=pools,
        )

    def register(
        self,
        pool_id: str,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        eviction_policy: str = "lru",
    ) -> PoolInfo:
        """Create or replace a pool. A new epoch is issued; the previous epoch's sequences and
        cached hashes are dropped and its epoch refused from now on."""
        if not pool_id or len(pool_id) > MAX_POOL_ID_LEN:
            raise invalid(f"pool_id must be 1..{MAX_POOL_ID_LEN} characters")
        if not 2 <= num_blocks <= MAX_BLOCKS:
            raise invalid(f"num_blocks must be in [2, {MAX_BLOCKS}], got {num_blocks}")
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise invalid(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
        if eviction_policy not in POLICIES:
            raise invalid(f"eviction_policy {eviction_policy!r} is not one of {sorted(POLICIES)}")
        manager = KVBlockManager(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            eviction_policy=eviction_policy,
        )
        with self._lock:
            # Epochs are unique across restarts of this process too (time-based floor), so an
            # executor holding an epoch from before a restart can never be mistaken for current.
            epoch = max(next(self._epoch_counter), time.time_ns() // 1000)
            self._epoch_counter = itertools.count(epoch + 1)
            info = PoolInfo(
                pool_id, epoch, num_blocks, block_size, enable_prefix_caching, eviction_policy
            )
            replaced = pool_id in self._pools
            self._pools[pool_id] = _Pool(info, manager)
            log = self._events.setdefault(pool_id, _EventLog(self._event_buffer))
            if replaced:
                self._publish(pool_id, log, epoch, [(KVEventKind.CLEARED, ())])
        return info

    # ---- per-pool -------------------------------------------------------------------------

    def step(self, pool_id: str, epoch: int, ops: Sequence[Operation]) -> StepResult:
        with self._lock:
            pool = self._checked(pool_id, epoch)
            manager = pool.manager
            try:
                results = manager.step(ops)
            finally:
                self._flush_events(pool_id, pool)
            pool.num_steps += 1
            return StepResult(tuple(results), manager.counters())

    def restore(
        self, pool_id: str, epoch: int, sequences: Sequence[RestoredSequence]
    ) -> RestoreResult:
        with self._lock:
            pool = self._checked(pool_id, epoch)
            try:
                stored = pool.manager.restore(sequences)
            finally:
                self._flush_events(pool_id, pool)
            return RestoreResult(len(sequences), stored, pool.manager.counters())

    def stats(self, pool_id: str) -> PoolStats:
        with self._lock:
            pool = self._pool(pool_id)
            m = pool.manager
            return PoolStats(
                pool=pool.info,
                counters=m.counters(),
                prefix_cache_queries_tokens=m.prefix_queries_tokens,
                prefix_cache_hits_tokens=m.prefix_hits_tokens,
                num_evicted_blocks=m.pool.num_evicted,
                num_cow_copies=m.num_cow_copies,
                num_steps=pool.num_steps,
                last_event_seq=self._events[pool_id].next_seq - 1,
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

    def _checked(self, pool_id: str, epoch: int) -> _Pool:
        pool = self._pool(pool_id)
        if epoch != pool.info.epoch:
            raise precondition(
                f"stale epoch {epoch} for pool {pool_id!r} (current {pool.info.epoch}); "
                "re-register and restore"
            )
        return pool

    def _flush_events(self, pool_id: str, pool: _Pool) -> None:
        pending = pool.manager.pool.events
        if not pending:
            return
        grouped: list[tuple[KVEventKind, tuple[bytes, ...]]] = []
        run: list[bytes] = []
        kind = pending[0][0]
        for event_kind, block_hash in pending:
            if event_kind != kind:
                grouped.append((kind, tuple(run)))
                run, kind = [], event_kind
            run.append(block_hash)
        grouped.append((kind, tuple(run)))
        pending.clear()
        self._publish(pool_id, self._events[pool_id], pool.info.epoch, grouped)

    def _publish(
        self,
        pool_id: str,
        log: _EventLog,
        epoch: int,
        grouped: list[tuple[KVEventKind, tuple[bytes, ...]]],
    ) -> None:
        events = []
        for kind, hashes in grouped:
            events.append(KVEvent(log.next_seq, epoch, kind, hashes))
            log.next_seq += 1
        log.buffer.extend(events)
        for listener in list(log.listeners):
            listener(pool_id, events)
