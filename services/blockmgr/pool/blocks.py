"""Physical block metadata of one pool: refcounts, cached hashes, the free structures.

Invariants (checked by the property tests):
- block 0 is never handed out; every other block is either in use (refcount > 0) or free;
- a free block is in exactly one free structure: the uncached queue (no hash) or the eviction
  policy (it still holds a committed hash and stays matchable until reused);
- ``hash_to_block[h] == b`` iff ``block_hash[b] == h``.

The pool knows nothing of sequences; :class:`services.blockmgr.pool.manager.KVManager` owns block
tables.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from services.blockmgr.api.types import EvictionPolicyName, KVEventKind, PendingEvent, Uncache
from services.blockmgr.eviction.pins import SessionPins
from services.blockmgr.eviction.retention import DEFAULT_RETENTION_STEPS, RetentionLevels
from services.blockmgr.tiers.host_tier import HostTier
from services.blockmgr.tiers.moves import TierRun
from services.common.blocks import usable_blocks


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        eviction_policy: EvictionPolicyName = EvictionPolicyName.LRU,
        retention_steps: int = DEFAULT_RETENTION_STEPS,
        host_blocks: int = 0,
        disk_blocks: int = 0,
        tier_policy: EvictionPolicyName = EvictionPolicyName.LRU,
        pin_budget: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self._uncached: deque[int] = deque(range(1, num_blocks))
        # The eviction order of cached free blocks: the policy, per retention priority, then
        # the blocks session pins keep (eviction/pins.py).
        levels = RetentionLevels(
            eviction_policy, num_blocks - 1, self.block_hash.__getitem__, retention_steps
        )
        self._policy = SessionPins(levels, pin_budget, clock)
        self.eviction_policy = eviction_policy
        self.num_evicted = 0
        self.events: list[PendingEvent] = []
        # In-use blocks whose content equals a hashed block (two identical prompts computed at
        # once): hash -> those blocks, and back. One is promoted when the hashed one is evicted,
        # so the hash stays matchable while any copy of it lives.
        self._duplicates: dict[bytes, set[int]] = {}
        self._duplicate_of: dict[int, bytes] = {}
        # Per block: the Step it was last freed at, and the prefix hits its content served;
        # summed over evictions (the age of a block at eviction, its reuse).
        self._freed_at = [0] * num_blocks
        self._reuse = [0] * num_blocks
        self.eviction_age_steps = 0
        self.eviction_reuse = 0
        # The host tier, if any: blocks evicted here are offloaded there (host_tier.py).
        # and those the host tier evicts are spilled to the disk tier below it, if any.
        self.disk = HostTier(disk_blocks, policy=tier_policy) if disk_blocks else None
        self.host = HostTier(host_blocks, self.disk, tier_policy) if host_blocks else None

    @property
    def num_usable(self) -> int:
        return usable_blocks(self.num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._uncached) + len(self._policy)

    @property
    def num_cached_free(self) -> int:
        return len(self._policy)

    def allocate(self) -> int:
        """A free block with refcount 1: an uncached one if any, else the policy's victim.

        The caller has checked ``num_free``; evicting a cached block drops its hash."""
        if self._uncached:
            block_id = self._uncached.popleft()
            if self.host is not None:  # a swap-in of this Step may fill it yet: cancelled
                self._cancel_fills(block_id, None)
        else:
            block_id = self._policy.pop()
            if self.host is not None:
                self._offload(block_id)
            self._drop_hash(block_id)
            self.num_evicted += 1
            self.eviction_age_steps += self._policy.step - self._freed_at[block_id]
            self.eviction_reuse += self._reuse[block_id]
        self._reuse[block_id] = 0
        self._policy.clear(block_id)
        self.refcount[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """Share a block; a cached free block comes back out of the eviction queue."""
        if self.refcount[block_id] == 0:
            self._policy.remove(block_id)
        self.refcount[block_id] += 1

    def decref(self, block_id: int) -> bool:
        """Drop one reference; return True if the block became free."""
        ref = self.refcount[block_id] - 1
        self.refcount[block_id] = ref
        if ref:
            return False
        if self.block_hash[block_id] is None:
            if block_id in self._duplicate_of:  # a free copy is not worth keeping
                self._forget_duplicate(block_id)
            self._uncached.append(block_id)
        else:
            self._policy.push(block_id)
            self._freed_at[block_id] = self._policy.step
        return True

    def _offload(self, block_id: int) -> None:
        """An evicted block's content goes to the host tier, unless a live copy of it keeps
        its hash here (a duplicate takes it over), or a tier's move of this Step was to fill
        it (cancelled: that tier's slot keeps the block)."""
        key = self.block_hash[block_id]
        if self._cancel_fills(block_id, key):
            return
        if key is not None and not self._duplicates.get(key):
            assert self.host is not None
            self.host.offload(block_id, key)

    def _cancel_fills(self, block_id: int, key: bytes | None) -> bool:
        assert self.host is not None
        if self.disk is not None and self.disk.cancel_fill(block_id, key):
            return True
        return self.host.cancel_fill(block_id, key)

    @property
    def sizes(self) -> tuple[int, int, int]:
        """Blocks (the null block included), host slots, disk slots."""
        host, disk = self.host, self.disk
        return self.num_blocks, host.num_slots if host else 0, disk.num_slots if disk else 0

    def uncache(self, op: Uncache) -> int:
        """Forget the keys these blocks and tier slots are cached under (a move into them
        failed); returns how many. A block in use stays so, freed uncached; a cached free one
        is uncached free now; a live copy of its content takes its hash over."""
        forgotten = 0
        for block_id in op.device_blocks:
            if block_id in self._duplicate_of:  # its content is no copy of anything now
                self._forget_duplicate(block_id)
            if self.block_hash[block_id] is None:
                continue
            forgotten += 1
            if self.refcount[block_id]:
                self._drop_hash(block_id)
                continue
            self._policy.discard(block_id)
            self._drop_hash(block_id)
            self._policy.clear(block_id)
            self._uncached.append(block_id)
        for tier, slots in ((self.host, op.host_slots), (self.disk, op.disk_slots)):
            for slot in slots:
                assert tier is not None  # (validated)
                forgotten += tier.uncache(slot)
        return forgotten

    def retain(self, block_id: int, priority: int) -> None:
        """An in-use block is to be kept with at least this retention priority once freed."""
        if priority:
            self._policy.retain(block_id, priority)

    def pin(self, block_id: int, ttl_s: float) -> None:
        """An in-use block is to be kept ``ttl_s`` seconds once freed (a session pin)."""
        if ttl_s:
            self._policy.pin(block_id, ttl_s)

    @property
    def pins(self) -> SessionPins:
        return self._policy

    def tick(self) -> None:
        """One Step of the pool went by (retention priorities expire in Steps, pins in
        seconds)."""
        self._policy.tick()

    @property
    def num_demoted(self) -> int:
        """Retained blocks whose priority expired while they were free."""
        return self._policy.num_demoted

    def lookup(self, block_hash: bytes) -> int | None:
        """The block cached under ``block_hash`` (a cache key), if any; a miss is told to the
        eviction policy (a ghost hit for the policies that remember evicted keys)."""
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None:
            self._policy.missed(block_hash)
        return block_id

    def note_hit(self, block_id: int) -> None:
        """A prefix hit on the block (before its incref): counted for its reuse."""
        self._reuse[block_id] += 1
        if self.refcount[block_id]:
            self._policy.touch(block_id)

    def store(self, block_id: int, block_hash: bytes) -> bool:
        """Make an in-use, full block matchable under ``block_hash``.

        Returns False (and stores nothing) when the block already has a hash or another block
        already holds this one: the first writer wins, and the duplicate is remembered to take
        the hash over should the first be evicted while it lives."""
        if self.block_hash[block_id] is not None:
            return False
        holder = self.hash_to_block.get(block_hash)
        if holder is not None:
            if holder != block_id and block_id not in self._duplicate_of:
                self._duplicates.setdefault(block_hash, set()).add(block_id)
                self._duplicate_of[block_id] = block_hash
            return False
        self.block_hash[block_id] = block_hash
        self.hash_to_block[block_hash] = block_id
        self.events.append((KVEventKind.STORED, block_hash))
        return True

    def cache_key(self, block_id: int) -> bytes | None:
        """The key the block's content is matchable under (or would be, as a duplicate)."""
        key = self.block_hash[block_id]
        return key if key is not None else self._duplicate_of.get(block_id)

    def take_free(self, block_ids: set[int]) -> None:
        """Take specific free blocks out of the free structures (restore), dropping their hashes;
        their refcounts are left at 0 for the caller to set."""
        for block_id in block_ids:
            if block_id in self._policy:
                self._policy.discard(block_id)
                self._drop_hash(block_id)
            self._policy.clear(block_id)  # no retention priority carries over
        self._uncached = deque(b for b in self._uncached if b not in block_ids)

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.hash_to_block[block_hash]
            self.block_hash[block_id] = None
            self._policy.forget(block_id, block_hash)
            self.events.append((KVEventKind.REMOVED, block_hash))
            copies = self._duplicates.get(block_hash)
            if copies:  # a live copy holds the same KV: it takes the hash over
                heir = min(copies)
                self._forget_duplicate(heir)
                self.block_hash[heir] = block_hash
                self.hash_to_block[block_hash] = heir
                self.events.append((KVEventKind.STORED, block_hash))

    def _forget_duplicate(self, block_id: int) -> None:
        block_hash = self._duplicate_of.pop(block_id)
        copies = self._duplicates[block_hash]
        copies.discard(block_id)
        if not copies:
            del self._duplicates[block_hash]

    def free_block_ids(self) -> list[int]:
        """All free block ids (for invariant checks and tests; O(n))."""
        return list(self._uncached) + [b for b in range(1, self.num_blocks) if b in self._policy]

    def fill_from_tiers(
        self, run: TierRun, priority: int, pin_ttl_s: float = 0.0
    ) -> tuple[list[int], int]:
        """New device blocks for ``run``, to be filled from their tiers: matchable on the device
        at once (the executor fills them before any forward). Returns them and how many came
        from the disk."""
        for _, tier, slot in run:  # read in this Step: no offload or spill may take these slots
            tier.pin(slot)
        blocks = []
        from_disk = 0
        for block_hash, tier, slot in run:
            block_id = self.allocate()
            tier.onboard(slot, block_id)
            from_disk += tier is self.disk
            self.store(block_id, block_hash)
            self.note_hit(block_id)  # a prefix hit, from a tier
            if priority:
                self.retain(block_id, priority)
            self.pin(block_id, pin_ttl_s)
            blocks.append(block_id)
        return blocks, from_disk
