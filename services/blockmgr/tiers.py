"""A pool's tiers below the device at admission (pure logic, no I/O): the prefix hit goes on
past the device in the host tier and the disk tier below it, block by block, and those blocks
are filled into new device blocks (onboards from the host, loads from the disk)."""

from __future__ import annotations

from collections.abc import Sequence

from services.blockmgr.host_tier import HostTier
from services.blockmgr.pool import BlockPool
from services.blockmgr.types import BlockMove, SlotMove

__all__ = ["TierMoves", "TierRun", "fill_from_tiers", "take_moves", "tier_lookup", "tier_run"]

TierRun = list[tuple[bytes, HostTier, int]]  # (hash, the tier holding it, its slot)
TierMoves = tuple[
    tuple[BlockMove, ...],
    tuple[BlockMove, ...],
    tuple[SlotMove, ...],
    tuple[SlotMove, ...],
    tuple[SlotMove, ...],
]


def tier_lookup(pool: BlockPool, key: bytes) -> tuple[HostTier, int] | None:
    """The tier below the device holding ``key`` (a cache key), and its slot: the host tier,
    else the disk tier, else None."""
    host, disk = pool.host, pool.disk
    assert host is not None
    slot = host.lookup(key)
    if slot is not None:
        return host, slot
    slot = disk.lookup(key) if disk is not None else None
    if slot is None:
        return None
    assert disk is not None
    return disk, slot


def tier_run(pool: BlockPool, block_hashes: Sequence[bytes]) -> TierRun:
    """The leading run of ``block_hashes`` the host or the disk tier holds, each block in
    either."""
    run: TierRun = []
    for block_hash in block_hashes:
        where = tier_lookup(pool, block_hash)
        if where is None:
            break
        run.append((block_hash, *where))
    return run


def fill_from_tiers(pool: BlockPool, run: TierRun, priority: int) -> tuple[list[int], int]:
    """New device blocks for ``run``, to be filled from their tiers: matchable on the device
    at once (the executor fills them before any forward). Returns them and how many came
    from the disk."""
    for _, tier, slot in run:  # read in this Step: no offload or spill may take these slots
        tier.pin(slot)
    blocks = []
    from_disk = 0
    for block_hash, tier, slot in run:
        block_id = pool.allocate()
        tier.onboard(slot, block_id)
        from_disk += tier is pool.disk
        pool.store(block_id, block_hash)
        pool.note_hit(block_id)  # a prefix hit, from a tier
        if priority:
            pool.retain(block_id, priority)
        blocks.append(block_id)
    return blocks, from_disk


def take_moves(pool: BlockPool) -> TierMoves:
    """The tiers' (offloads, onboards, spills, loads, stores) of the Step just applied."""
    host, disk = pool.host, pool.disk
    if host is None:
        return (), (), (), (), ()
    offloads, onboards = host.moves()
    if disk is None:
        return offloads, onboards, (), (), ()
    spills, loads = disk.moves()
    return (
        offloads,
        onboards,
        tuple(SlotMove(m.device_block, m.host_slot) for m in spills),
        tuple(SlotMove(m.host_slot, m.device_block) for m in loads),
        tuple(SlotMove(m.device_block, m.host_slot) for m in disk.stores()),
    )
