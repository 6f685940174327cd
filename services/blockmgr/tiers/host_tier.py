"""A pool's host tier: the executor's host memory for blocks evicted from the device (pure
bookkeeping: the executor holds the bytes and performs the moves).

The tier has ``num_slots`` block-sized slots. The block manager records which cached key each
slot holds and decides every move; the executor performs them in the Step they come in, before
its forward:

1. **offloads** (device block -> host slot): a cached block evicted from the device (its slot
   reused for other content) is copied down first, instead of being dropped, when its key is
   not in the tier yet. A free slot is taken, else the one the tier's eviction policy picks
   (LRU by default) among the cached slots no move of this Step reads.
2. **onboards** (host slot -> device block): an admission whose prefix continues in the tier
   past its device hit gets new device blocks for those blocks, filled from the tier; they
   count as cached tokens. The tier is exclusive: an onboarded block leaves it (its slot is
   free again once the Step is over), so device and tier together hold as many distinct
   blocks as they have slots; evicted from the device again, it is offloaded again.

Offloads are performed before onboards and copy-on-write copies (an onboard or a copy may
write into a device block just evicted), a slot an onboard reads is pinned until the Step
ends (no offload of the same Step overwrites it), and a fill of a device block that is reused
before it ran is cancelled (:meth:`HostTier.cancel_fill`). A Step's moves are done before the next
Step is applied (the executor runs them in order, ahead of the forward that needs them), so
pins need not outlive the Step. The tier map is dropped with the pool (a new registration):
after a block-manager restart its slots are simply not cached, never wrong.

Preemption by swapping (:mod:`services.blockmgr.pool.swap`) takes slots of the same tier: a
swapped-out sequence's slots are held for it (refcounted: sequences swapped out together
share a block's slot), out of the cache's eviction order, until it is swapped in or freed.
Restore rebuilds them from the executor's view (it still holds their content).

A **disk tier** (``below``) is another instance of this class under the host tier: a cached
host slot evicted for other content is *spilled* there (host slot -> disk slot, an offload of
the disk tier) instead of dropped. A host slot an offload of this Step wrote (its bytes are not
there yet when the spills run) is not spilled: that offload goes straight to the disk instead
(a *store*, device block -> disk slot, made after the offloads and before any fill). A prefix
hit in the disk tier is loaded straight into a device block (an onboard of the disk tier). The
executor runs a Step's moves in this order: spills, offloads, stores, host onboards, disk
loads; so a spill reads a host slot before an offload overwrites it, a store reads its device
block before a fill overwrites it, and a load reads a disk slot after the Step wrote it.
"""

from __future__ import annotations

from services.blockmgr.api.types import BlockMove, EvictionPolicyName, KVEventKind, PendingEvent
from services.blockmgr.eviction.policies import EvictionPolicy, make_policy

__all__ = ["HostTier"]


class HostTier:
    def __init__(
        self,
        num_slots: int,
        below: HostTier | None = None,
        policy: EvictionPolicyName | str = EvictionPolicyName.LRU,
    ) -> None:
        """``below``: the disk tier this one spills into, if any. ``policy``: the order in
        which cached slots are reused (a hit in the tier, an offload or a spill of a key it
        holds, counts as a use)."""
        self.num_slots = num_slots
        self.below = below
        self.slot_of: dict[bytes, int] = {}
        self.key_of: list[bytes | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        # The cached slots (neither free, pinned nor swapped out), in eviction order.
        self._order: EvictionPolicy = make_policy(policy, num_slots, self.key_of.__getitem__)
        self._pinned: set[int] = set()
        self._released: list[int] = []  # onboarded this Step: free from the next one
        self._onboarded: dict[int, int] = {}  # device block -> the slot it is filled from
        self._written: dict[int, int] = {}  # slot -> its offload of this Step (index)
        self._stored: set[int] = set()  # offloads (index) whose source is a device block
        self._swapped_in: set[int] = set()  # device blocks a swap-in of this Step fills
        self.events: list[PendingEvent] = []  # KV events of the tier (medium: host)
        self.offloads: list[BlockMove] = []
        self.onboards: list[BlockMove] = []
        self.num_offloaded = 0
        self.num_onboarded = 0
        self.num_evicted = 0
        self._swap_refs: dict[int, int] = {}  # slot -> swapped-out tables holding it
        self.swap_key: dict[int, bytes] = {}  # swapped slot -> its block's cache key, if any
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    def lookup(self, key: bytes) -> int | None:
        slot = self.slot_of.get(key)
        if slot is None:
            self._order.missed(key)
        return slot

    def _used(self, slot: int) -> None:
        self._order.remove(slot)
        self._order.push(slot)

    def offload(self, src: int, key: bytes) -> None:
        """``src`` (a device block; in the disk tier, a host slot: a spill), cached under
        ``key``, is about to be reused: keep a copy in this tier (nothing when the key is here
        or in the tier below already); with no slot to take, it goes straight to the tier
        below, if any (else nowhere)."""
        if self.touch(key) or (self.below is not None and self.below.touch(key)):
            return  # (the tiers are exclusive)
        slot = self._take_slot()
        if slot is None:  # every slot is read by a move of this Step, or swapped out
            if self.below is not None:
                self.below.store(src, key)  # (src: a device block)
            return
        self._keep(slot, key)
        self._written[slot] = len(self.offloads)
        self.offloads.append(BlockMove(src, slot))
        self.num_offloaded += 1

    def store(self, block_id: int, key: bytes) -> None:
        """Disk tier: device block ``block_id``, cached under ``key``, goes straight here (its
        host slot was taken again in this Step): as :meth:`offload`, from the device."""
        before = len(self.offloads)
        self.offload(block_id, key)
        if len(self.offloads) > before:
            self._stored.add(before)

    def touch(self, key: bytes) -> bool:
        """Whether the tier holds ``key`` (then it is the most recently used)."""
        slot = self.slot_of.get(key)
        if slot is None:
            return False
        self._used(slot)
        return True

    def cancel_fill(self, block_id: int, key: bytes | None) -> bool:
        """Device block ``block_id``, to be filled from this tier by a move of this very Step,
        is reused (evicted, or freed uncached) before that move ran: the move is cancelled (a
        later fill of the block in the Step must not be overwritten by it). An onboarded
        slot keeps its block under ``key``, as if never read; a swap-in's is simply not
        cached. Returns whether there was such a move."""
        slot = self._onboarded.pop(block_id, None)
        if slot is None:
            if block_id not in self._swapped_in:
                return False
            self._swapped_in.discard(block_id)
            self.num_swapped_in -= 1
        else:
            self.num_onboarded -= 1
            if key is not None and key not in self.slot_of:
                self._released.remove(slot)
                self._keep(slot, key)
        self.onboards = [m for m in self.onboards if m.device_block != block_id]
        return True

    def _keep(self, slot: int, key: bytes) -> None:
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self._order.push(slot)
        self.events.append((KVEventKind.STORED, key))

    def onboard(self, slot: int, block_id: int) -> None:
        """Fill device block ``block_id`` from ``slot``, which then leaves the tier: its key
        at once (the device block holds it now), the slot itself once the Step is over (the
        copy reads it)."""
        self.pin(slot)
        key = self.key_of[slot]
        if key is not None:
            del self.slot_of[key]
            self.key_of[slot] = None
            self.events.append((KVEventKind.REMOVED, key))
            self._order.forget(slot, key)
        self._released.append(slot)
        self._onboarded[block_id] = slot
        self.onboards.append(BlockMove(block_id, slot))
        self.num_onboarded += 1

    def pin(self, slot: int) -> None:
        """``slot`` is read by a move of this Step: out of the eviction order until the Step
        is over (a read is a use of its block)."""
        if slot in self._order:
            self._order.remove(slot)
        self._pinned.add(slot)

    def begin_step(self) -> None:
        """A new Step: the last one's moves are the executor's now, its pins released."""
        self.offloads.clear()
        self.onboards.clear()
        self._pinned.clear()
        self._free.extend(self._released)
        self._released.clear()
        self._onboarded.clear()
        self._written.clear()
        self._stored.clear()
        self._swapped_in.clear()

    def moves(self) -> tuple[tuple[BlockMove, ...], tuple[BlockMove, ...]]:
        """This Step's (offloads, onboards): an offload into a slot that a later one of the
        Step took again is left out (nothing reads it)."""
        live = set(self._written.values()) - self._stored
        offloads = tuple(m for i, m in enumerate(self.offloads) if i in live)
        return offloads, tuple(self.onboards)

    def stores(self) -> tuple[BlockMove, ...]:
        """This Step's stores (device block -> slot of this tier), those not taken again."""
        live = set(self._written.values()) & self._stored
        return tuple(m for i, m in enumerate(self.offloads) if i in live)

    # ---- preemption by swapping ------------------------------------------------------------

    def swap_room(self) -> int:
        """Slots a swap-out may take now: the free ones and the cached ones no move of this
        Step reads."""
        return len(self._free) + len(self._order)

    def swap_out(self, block_id: int, key: bytes | None) -> int:
        """A slot held for device block ``block_id`` of a sequence being swapped out, its
        copy recorded as an offload of this Step (the caller checked :meth:`swap_room`)."""
        slot = self._take_slot()
        assert slot is not None
        self._swap_refs[slot] = 1
        if key is not None:
            self.swap_key[slot] = key
        self._written[slot] = len(self.offloads)
        self.offloads.append(BlockMove(block_id, slot))
        self.num_swapped_out += 1
        return slot

    def share_swapped(self, slot: int) -> None:
        self._swap_refs[slot] += 1

    def swap_in(self, slot: int, block_id: int) -> None:
        """Fill device block ``block_id`` from swapped ``slot`` (an onboard of this Step)."""
        self._pinned.add(slot)
        self.onboards.append(BlockMove(block_id, slot))
        self._swapped_in.add(block_id)
        self.num_swapped_in += 1

    def release_swapped(self, slot: int) -> None:
        """A swapped-out table gives ``slot`` up; once none holds it, it is free at once, or
        from the next Step if an onboard of this Step reads it. (An offload of this Step into
        it is void once another takes it: :meth:`moves` keeps the last write of a slot.)"""
        ref = self._swap_refs[slot] - 1
        if ref:
            self._swap_refs[slot] = ref
            return
        del self._swap_refs[slot]
        self.swap_key.pop(slot, None)
        if slot in self._pinned:
            self._released.append(slot)
        else:
            self._free.append(slot)

    def hold_swapped(self, slot: int, key: bytes | None) -> None:
        """Restore: ``slot`` (in range, checked) holds a block of a swapped-out sequence."""
        if slot in self._swap_refs:
            self._swap_refs[slot] += 1
            return
        if slot in self._order:  # a cached block: dropped, as an eviction would
            self._order.discard(slot)
            old = self.key_of[slot]
            if old is not None:
                del self.slot_of[old]
                self.key_of[slot] = None
                self.events.append((KVEventKind.REMOVED, old))
                self._order.forget(slot, old)
        else:
            self._free.remove(slot)
        self._swap_refs[slot] = 1
        if key is not None:
            self.swap_key[slot] = key

    def uncache(self, slot: int) -> int:
        """Forget the key ``slot`` is cached under (a move into it failed): the slot is free.
        A swapped-out sequence's slot is left to it. Returns the keys forgotten (0 or 1)."""
        key = self.key_of[slot]
        if key is None or slot in self._swap_refs:
            return 0
        del self.slot_of[key]
        self.key_of[slot] = None
        self.events.append((KVEventKind.REMOVED, key))
        if slot in self._order:  # (else pinned: read by a move of this Step)
            self._order.discard(slot)
        self._order.forget(slot, key)
        (self._released if slot in self._pinned else self._free).append(slot)
        return 1

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._order:
            return None  # every slot is free-to-be, pinned or swapped out
        slot = self._order.pop()
        key = self.key_of[slot]
        if key is not None:
            del self.slot_of[key]
            self.events.append((KVEventKind.REMOVED, key))
            self._order.forget(slot, key)
            if self.below is not None:
                written = self._written.get(slot)
                if written is None:
                    self.below.offload(slot, key)  # a spill
                else:  # its bytes are not here yet: from the device, straight down
                    self.below.store(self.offloads[written].device_block, key)
                    self.num_offloaded -= 1  # (counted below instead)
        self.num_evicted += 1
        self._written.pop(slot, None)  # written earlier in this Step: that offload is void
        return slot

    def occupied(self) -> int:
        return len(self.slot_of)
