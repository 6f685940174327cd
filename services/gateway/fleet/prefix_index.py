"""Where cached prefixes live: which executor pool holds which block hashes.

Two sources feed the index of each pool:

- **confirmed** hashes, from the block manager's KV events (STORED adds, REMOVED drops,
  CLEARED empties: a new epoch, or the pool is gone). A hybrid pool (several KV-cache groups)
  stores and evicts a hash per group: it counts as held while any group holds it (its
  full-attention groups keep a prefix longest), on the device or in the pool's host tier;
- **provisional** hashes, from this gateway's own routing: a prompt sent to an executor will be
  cached there as soon as its prefill runs, a step or more before the STORED event arrives, so
  a burst of requests sharing a system prompt follows the first one instead of scattering.
  A provisional hash expires after ``provisional_ttl_s`` (the request may be refused, or its
  blocks evicted before they were committed) unless an event confirms or removes it first.

Event positions: sequence numbers are strictly increasing per pool id, across epochs and
across block-manager restarts. A consumer that resumes with the last number it saw and finds a
gap (events lost from the block manager's bounded buffer) cannot know what it missed: the pool
is emptied and rebuilt from the events that follow. The index only ever guides routing, so a
missed hash costs a prefill, never a wrong answer.

Pure: no gRPC, no asyncio; the caller feeds events and asks for matches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import structlog

from services.blockmgr.api.types import KVEvent, KVEventKind

log = structlog.get_logger(__name__)

DEFAULT_PROVISIONAL_TTL_S = 30.0
MAX_PROVISIONAL_PER_POOL = 1 << 17  # expired entries are swept when a pool holds more


@dataclass
class _Pool:
    epoch: int = 0
    last_seq: int = 0  # 0: no event seen yet
    synced: bool = False  # the event stream of this pool is live
    stored: dict[bytes, int] = field(default_factory=dict)  # hash -> bitmask of groups
    provisional: dict[bytes, float] = field(default_factory=dict)  # hash -> expiry time

    def clear(self) -> None:
        self.stored.clear()
        self.provisional.clear()


class PrefixIndex:
    def __init__(
        self,
        *,
        provisional_ttl_s: float = DEFAULT_PROVISIONAL_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.provisional_ttl_s = provisional_ttl_s
        self._clock = clock
        self._pools: dict[str, _Pool] = {}
        self.num_gaps = 0  # resumes that found events missing (the pool was rebuilt)

    # ---- the event stream ---------------------------------------------------------------------

    def last_seq(self, pool_id: str) -> int:
        """Resume position: the stream should replay events after this one."""
        pool = self._pools.get(pool_id)
        return pool.last_seq if pool else 0

    def set_synced(self, pool_id: str, synced: bool) -> None:
        """The pool's event stream is (or stopped being) live. An unsynced pool keeps its
        hashes (resuming from ``last_seq`` brings it up to date) but only its provisional
        entries count for routing until the stream is back."""
        self._pools.setdefault(pool_id, _Pool()).synced = synced

    def is_synced(self, pool_id: str) -> bool:
        pool = self._pools.get(pool_id)
        return pool is not None and pool.synced

    def apply(self, pool_id: str, events: Iterable[KVEvent]) -> None:
        """Apply events in stream order. Replayed events already seen are skipped."""
        pool = self._pools.setdefault(pool_id, _Pool())
        for ev in events:
            if pool.last_seq and ev.seq <= pool.last_seq:
                continue
            if ev.kind == KVEventKind.CLEARED:
                pool.clear()
            elif pool.last_seq and (ev.seq != pool.last_seq + 1 or ev.epoch != pool.epoch):
                # Events were lost (or an epoch began without its CLEARED in the replay):
                # what we hold may be stale; rebuild from here.
                self.num_gaps += 1
                log.warning(
                    "kv_events_gap",
                    pool_id=pool_id,
                    after_seq=pool.last_seq,
                    next_seq=ev.seq,
                    epoch=ev.epoch,
                )
                pool.clear()
            pool.epoch = ev.epoch
            pool.last_seq = ev.seq
            # One bit per (group, medium): a hash is held while any group holds it, on the
            # device or in its host tier (onboarding it costs far less than a prefill).
            stored, bit = pool.stored, 1 << (ev.group + 64 * ev.medium)
            if ev.kind == KVEventKind.STORED:
                for h in ev.block_hashes:
                    stored[h] = stored.get(h, 0) | bit
                    pool.provisional.pop(h, None)
            elif ev.kind == KVEventKind.REMOVED:
                for h in ev.block_hashes:
                    held = stored.pop(h, 0) & ~bit
                    if held:  # still held in another group
                        stored[h] = held
                    else:
                        pool.provisional.pop(h, None)

    def forget(self, pool_id: str) -> None:
        """The pool's executor is gone from the gateway: drop everything about it."""
        self._pools.pop(pool_id, None)

    # ---- routing ------------------------------------------------------------------------------

    def match(self, pool_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (its chained ``block_hashes``) the pool is
        expected to hold. Chained hashes make the first miss the end of the match."""
        pool = self._pools.get(pool_id)
        if pool is None:
            return 0
        now = self._clock()
        use_stored = pool.synced
        n = 0
        for h in block_hashes:
            if use_stored and h in pool.stored:
                n += 1
                continue
            expiry = pool.provisional.get(h)
            if expiry is None:
                break
            if expiry <= now:
                del pool.provisional[h]
                break
            n += 1
        return n

    def note_routed(self, pool_id: str, block_hashes: Sequence[bytes]) -> None:
        """A prompt with these full-block hashes was just sent to the pool's executor."""
        pool = self._pools.setdefault(pool_id, _Pool())
        expiry = self._clock() + self.provisional_ttl_s
        for h in block_hashes:
            if not (pool.synced and h in pool.stored):
                pool.provisional[h] = expiry
        if len(pool.provisional) > MAX_PROVISIONAL_PER_POOL:
            now = self._clock()
            pool.provisional = {h: t for h, t in pool.provisional.items() if t > now}
            while len(pool.provisional) > MAX_PROVISIONAL_PER_POOL:  # all live: oldest first
                pool.provisional.pop(next(iter(pool.provisional)))

    # ---- monitoring ---------------------------------------------------------------------------

    def num_blocks(self, pool_id: str) -> int:
        """Confirmed hashes known for the pool."""
        pool = self._pools.get(pool_id)
        return len(pool.stored) if pool else 0
