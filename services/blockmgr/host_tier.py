"""A pool's host tier: the executor's host memory for blocks evicted from the device (pure
bookkeeping: the executor holds the bytes and performs the moves).

The tier has ``num_slots`` block-sized slots. The block manager records which cached key each
slot holds and decides every move; the executor performs them in the Step they come in, before
its forward:

1. **offloads** (device block -> host slot): a cached block evicted from the device (its slot
   reused for other content) is copied down first, instead of being dropped, when its key is
   not in the tier yet. A free slot is taken, else the least recently used slot that no onboard
   of this Step reads.
2. **onboards** (host slot -> device block): an admission whose prefix continues in the tier
   past its device hit gets new device blocks for those blocks, filled from the tier; they
   count as cached tokens. The tier is exclusive: an onboarded block leaves it (its slot is
   free again once the Step is over), so device and tier together hold as many distinct
   blocks as they have slots; evicted from the device again, it is offloaded again.

Offloads are performed before onboards and copy-on-write copies (an onboard or a copy may
write into a device block just evicted), and a slot an onboard reads is pinned until the
Step ends (no offload of the same Step overwrites it). A Step's moves are done before the next
Step is applied (the executor runs them in order, ahead of the forward that needs them), so
pins need not outlive the Step. The tier map is dropped with the pool (a new registration):
after a block-manager restart its slots are simply not cached, never wrong.
"""

from __future__ import annotations

from collections import OrderedDict

from services.blockmgr.types import BlockMove, KVEventKind, PendingEvent

__all__ = ["HostTier"]


class HostTier:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slot_of: dict[bytes, int] = {}
        self.key_of: list[bytes | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()  # occupied slots, least recent first
        self._pinned: set[int] = set()
        self._released: list[int] = []  # onboarded this Step: free from the next one
        self._onboarded: dict[int, int] = {}  # device block -> the slot it is filled from
        self._written: dict[int, int] = {}  # slot -> its offload of this Step (index)
        self.events: list[PendingEvent] = []  # KV events of the tier (medium: host)
        self.offloads: list[BlockMove] = []
        self.onboards: list[BlockMove] = []
        self.num_offloaded = 0
        self.num_onboarded = 0
        self.num_evicted = 0

    def lookup(self, key: bytes) -> int | None:
        return self.slot_of.get(key)

    def offload(self, block_id: int, key: bytes) -> None:
        """Device block ``block_id``, cached under ``key``, is about to be reused: keep a copy
        in the tier (nothing when the key is there already or every slot is pinned)."""
        slot = self.slot_of.get(key)
        if slot is not None:
            self._lru.move_to_end(slot)
            return
        slot = self._onboarded.pop(block_id, None)
        if slot is not None:
            # Filled from ``slot`` in this very Step (the onboard runs after the offloads):
            # its content is still the slot's, which simply stays in the tier.
            self._released.remove(slot)
            self._keep(slot, key)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._keep(slot, key)
        self._written[slot] = len(self.offloads)
        self.offloads.append(BlockMove(block_id, slot))
        self.num_offloaded += 1

    def _keep(self, slot: int, key: bytes) -> None:
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self._lru[slot] = None
        self.events.append((KVEventKind.STORED, key))

    def onboard(self, slot: int, block_id: int) -> None:
        """Fill device block ``block_id`` from ``slot``, which then leaves the tier: its key
        at once (the device block holds it now), the slot itself once the Step is over (the
        copy reads it)."""
        self._pinned.add(slot)
        key = self.key_of[slot]
        if key is not None:
            del self.slot_of[key]
            self.key_of[slot] = None
            self.events.append((KVEventKind.REMOVED, key))
        del self._lru[slot]
        self._released.append(slot)
        self._onboarded[block_id] = slot
        self.onboards.append(BlockMove(block_id, slot))
        self.num_onboarded += 1

    def pin(self, slot: int) -> None:
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

    def moves(self) -> tuple[tuple[BlockMove, ...], tuple[BlockMove, ...]]:
        """This Step's (offloads, onboards): an offload into a slot that a later one of the
        Step took again is left out (nothing reads it)."""
        live = set(self._written.values())
        offloads = tuple(m for i, m in enumerate(self.offloads) if i in live)
        return offloads, tuple(self.onboards)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for slot in self._lru:  # least recently used first, skipping the pinned
            if slot not in self._pinned:
                break
        else:
            return None
        del self._lru[slot]
        key = self.key_of[slot]
        if key is not None:
            del self.slot_of[key]
            self.events.append((KVEventKind.REMOVED, key))
        self.num_evicted += 1
        self._written.pop(slot, None)  # written earlier in this Step: that offload is void
        return slot

    def occupied(self) -> int:
        return len(self.slot_of)
