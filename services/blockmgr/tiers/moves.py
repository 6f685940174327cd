"""A pool's tiers below the device at admission (pure logic, no I/O): the prefix hit goes on
past the device in the host tier and the disk tier below it, block by block (the pool fills
those blocks into new device blocks: onboards from the host, loads from the disk), and the
moves a Step leaves the executor to perform."""

from __future__ import annotations

from collections.abc import Sequence

from services.blockmgr.api.types import BlockMove, SlotMove
from services.blockmgr.tiers.host_tier import HostTier

__all__ = ["TierMoves", "TierRun", "take_moves", "tier_lookup", "tier_run"]

TierRun = list[tuple[bytes, HostTier, int]]  # (hash, the tier holding it, its slot)
TierMoves = tuple[
    tuple[BlockMove, ...],
    tuple[BlockMove, ...],
    tuple[SlotMove, ...],
    tuple[SlotMove, ...],
    tuple[SlotMove, ...],
]


def tier_lookup(host: HostTier, disk: HostTier | None, key: bytes) -> tuple[HostTier, int] | None:
    """The tier below the device holding ``key`` (a cache key), and its slot: the host tier,
    else the disk tier, else None."""
    slot = host.lookup(key)
    if slot is not None:
        return host, slot
    slot = disk.lookup(key) if disk is not None else None
    if slot is None:
        return None
    assert disk is not None
    return disk, slot


def tier_run(host: HostTier, disk: HostTier | None, block_hashes: Sequence[bytes]) -> TierRun:
    """The leading run of ``block_hashes`` the host or the disk tier holds, each block in
    either."""
    run: TierRun = []
    for block_hash in block_hashes:
        where = tier_lookup(host, disk, block_hash)
        if where is None:
            break
        run.append((block_hash, *where))
    return run


def take_moves(host: HostTier | None, disk: HostTier | None) -> TierMoves:
    """The tiers' (offloads, onboards, spills, loads, stores) of the Step just applied."""
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
