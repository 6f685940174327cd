"""Preemption by swapping (pure logic, no I/O): a sequence's blocks go to the host tier and
come back, instead of being recomputed (the PagedAttention paper's other option).

**SwapOut** copies every block of a live sequence's table to a host slot held for it (an
offload of the Step; a block listed by several sequences of one SwapOut gets one slot, shared),
then releases its device blocks as a Free does: its committed blocks stay matchable on the
device while they are not evicted. The sequence is then *swapped out*: its id stays taken, and
only SwapIn or Free may name it. An entry is all or nothing: RESOURCE_EXHAUSTED when the tier
has fewer slots than it needs that no swapped-out sequence holds and no move of this Step
reads (it stays live, unchanged).

**SwapIn** gives it back a table of the same length and the same token slots: a block whose
hash is still cached on the device is shared (no copy), every other one gets a new device block
filled from its slot (an onboard of the Step) and, if it had a hash, is matchable again at once.
RESOURCE_EXHAUSTED (it stays swapped out) when the pool has too few free blocks.

Any pool swaps, hybrid and sliding ones included: a sequence's tables travel group-major, as
one list of slots (:data:`NO_SLOT` for an entry released out of a sliding group's window,
which stays released), and come back with the same null entries. A block of one group held
in a slot comes back to that group (its cache key carries the group).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.blockmgr.api.errors import invalid
from services.blockmgr.api.types import (
    NO_SLOT,
    OpStatus,
    RestoredSequence,
    SwapIn,
    SwapInResult,
    SwapOut,
    SwapOutResult,
)
from services.blockmgr.pool.checks import check_hashes, check_seq_id
from services.blockmgr.pool.groups import group_key
from services.blockmgr.pool.tables import SwappedSeq, TableState
from services.common.blocks import NULL_BLOCK, blocks_for_tokens

__all__ = [
    "NO_SLOT",
    "check_swapped",
    "restore_swapped",
    "swap_in",
    "swap_out",
]


def swap_out(st: TableState, op: SwapOut, failed: set[int]) -> SwapOutResult:
    pool = st.pool
    host = pool.host
    assert host is not None  # validated: the pool has a host tier
    statuses: list[OpStatus] = []
    slots_out: list[tuple[int, ...]] = []
    freed = 0
    placed: dict[int, int] = {}  # device block -> its slot, within this op
    for seq_id in op.seq_ids:
        if seq_id in failed:
            statuses.append(OpStatus.SKIPPED)
            slots_out.append(())
            continue
        state = st.seqs[seq_id]
        blocks = [b for table in state.tables for b in table]
        new = {b for b in blocks if b != NULL_BLOCK and b not in placed}
        if len(new) > host.swap_room():
            failed.add(seq_id)
            statuses.append(OpStatus.RESOURCE_EXHAUSTED)
            slots_out.append(())
            continue
        slots = []
        for block_id in blocks:
            slot = placed.get(block_id)
            if block_id == NULL_BLOCK:
                slot = NO_SLOT
            elif slot is None:
                slot = host.swap_out(block_id, pool.cache_key(block_id))
                placed[block_id] = slot
            else:
                host.share_swapped(slot)
            slots.append(slot)
        st.swapped[seq_id] = SwappedSeq(slots, state.num_tokens, state.priority, state.num_slots)
        freed += st.release([seq_id])
        statuses.append(OpStatus.OK)
        slots_out.append(tuple(slots))
    return SwapOutResult(tuple(statuses), tuple(slots_out), freed)


def swap_in(st: TableState, op: SwapIn, failed: set[int]) -> SwapInResult:
    pool = st.pool
    host = pool.host
    assert host is not None
    statuses: list[OpStatus] = []
    tables: list[tuple[int, ...]] = []
    placed: dict[int, int] = {}  # slot -> its device block, within this op
    refcount, cached = pool.refcount, pool.hash_to_block
    caching = st.enable_prefix_caching
    for seq_id in op.seq_ids:
        if seq_id in failed:
            statuses.append(OpStatus.SKIPPED)
            tables.append(())
            continue
        swapped = st.swapped[seq_id]
        # Blocks still cached on the device are shared; the others need a free block each.
        found: dict[int, int] = {}
        cost = 0
        for slot in set(swapped.slots):
            if slot in placed or slot == NO_SLOT:
                continue
            key = host.swap_key.get(slot) if caching else None
            block_id = cached.get(key) if key is not None else None
            if block_id is not None:
                found[slot] = block_id
                cost += refcount[block_id] == 0
            else:
                cost += 1
        if cost > pool.num_free:
            failed.add(seq_id)
            statuses.append(OpStatus.RESOURCE_EXHAUSTED)
            tables.append(())
            continue
        for slot, block_id in found.items():  # first: no allocation below may evict them
            pool.incref(block_id)
            placed[slot] = block_id
        table = []
        for slot in swapped.slots:
            if slot == NO_SLOT:
                table.append(NULL_BLOCK)
                continue
            block_id = placed.get(slot)
            if block_id is None:
                block_id = pool.allocate()
                host.swap_in(slot, block_id)
                key = host.swap_key.get(slot) if caching else None
                if key is not None:
                    pool.store(block_id, key)
                placed[slot] = block_id
            elif slot not in found:  # placed by an earlier entry: shared
                pool.incref(block_id)
            if swapped.priority:
                pool.retain(block_id, swapped.priority)
            host.release_swapped(slot)
            table.append(block_id)
        del st.swapped[seq_id]
        n = len(table) // st.num_groups
        by_group = [table[g * n : (g + 1) * n] for g in range(st.num_groups)]
        lives = [next((i for i, b in enumerate(t) if b != NULL_BLOCK), n) for t in by_group]
        st.adopt(seq_id, by_group, swapped.num_tokens, lives, swapped.priority, swapped.num_slots)
        statuses.append(OpStatus.OK)
        tables.append(tuple(table))
    return SwapInResult(tuple(statuses), tuple(tables))


def check_swapped(st: TableState, sequences: Sequence[RestoredSequence]) -> None:
    """Validate the swapped-out ones of ``sequences`` to restore (those with ``host_slots``);
    INVALID_ARGUMENT naming the field. Ids are checked with the live ones."""
    host = st.pool.host
    for i, seq in enumerate(sequences):
        if not seq.host_slots:
            continue
        where = f"sequences[{i}]"
        if host is None:
            raise invalid(f"{where}.host_slots: the pool has no host tier (host_blocks)")
        check_seq_id(seq.seq_id, f"{where}.seq_id")
        if seq.block_ids:
            raise invalid(f"{where}: a swapped-out sequence has host_slots, not block_ids")
        per_group = blocks_for_tokens(seq.num_slots, st.block_size)
        n = per_group * st.num_groups
        if len(seq.host_slots) != n:
            raise invalid(
                f"{where}.host_slots: {seq.num_slots} token slots in {st.num_groups} group(s) "
                f"need {n} slots, got {len(seq.host_slots)}"
            )
        held = [slot for slot in seq.host_slots if slot != NO_SLOT]
        if len(set(held)) != len(held):
            raise invalid(f"{where}.host_slots holds a slot twice")
        leading = True  # (within the group's run so far, every entry was released)
        for j, slot in enumerate(seq.host_slots):
            g, i = divmod(j, per_group)
            leading = leading or i == 0
            if slot == NO_SLOT:
                # Only a sliding group's leading entries are released.
                if not (st.windows[g] and leading):
                    raise invalid(f"{where}.host_slots[{j}]: no entry there is released")
                continue
            leading = False
            if not 0 <= slot < host.num_slots:
                raise invalid(f"{where}.host_slots[{j}] = {slot} is out of range")
        check_hashes(seq.block_hashes, f"{where}.block_hashes")


def restore_swapped(st: TableState, sequences: Sequence[RestoredSequence]) -> None:
    """Rebuild the swapped-out ones of ``sequences`` (checked by :func:`check_swapped`)."""
    host = st.pool.host
    for seq in sequences:
        if not seq.host_slots:
            continue
        assert host is not None
        per_group = len(seq.host_slots) // st.num_groups
        for j, slot in enumerate(seq.host_slots):
            if slot == NO_SLOT:
                continue
            g, i = divmod(j, per_group)
            block_hash = seq.block_hashes[i] if i < len(seq.block_hashes) else None
            host.hold_swapped(slot, group_key(block_hash, g) if block_hash is not None else None)
        st.swapped[seq.seq_id] = SwappedSeq(
            list(seq.host_slots), seq.num_tokens, num_slots=seq.num_slots
        )
