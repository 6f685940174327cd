"""Protobuf <-> domain conversion of a Step's answer (operation results, counters): a part
of :mod:`services.blockmgr.api.convert`, which re-exports it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from pagedserve.v1 import blockmgr_pb2 as pb
from services.blockmgr.api.types import (
    AdmitResult,
    BlockCopy,
    BlockMove,
    CommitResult,
    ForkResult,
    FreeResult,
    GrowResult,
    OpResult,
    OpStatus,
    PoolCounters,
    SlotMove,
    StepResult,
    SwapInResult,
    SwapOutResult,
    UncacheResult,
)

__all__ = [
    "counters_from_pb",
    "counters_to_pb",
    "result_from_pb",
    "result_to_pb",
    "step_from_pb",
    "step_to_pb",
]


# The domain enums (IntEnum) carry the proto's values (checked in tests/test_protos.py):
# handing them over needs no mapping, only a type.
def _pb_status(status: OpStatus) -> pb.OpStatus:
    return cast(pb.OpStatus, status)


def _pb_statuses(statuses: Sequence[OpStatus]) -> Sequence[pb.OpStatus]:
    return cast(Sequence[pb.OpStatus], statuses)


# ---- results -----------------------------------------------------------------------------


def counters_to_pb(c: PoolCounters) -> pb.PoolCounters:
    return pb.PoolCounters(
        num_usable_blocks=c.num_usable_blocks,
        num_free_blocks=c.num_free_blocks,
        num_cached_free_blocks=c.num_cached_free_blocks,
        num_in_use_blocks=c.num_in_use_blocks,
        num_sequences=c.num_sequences,
    )


def counters_from_pb(c: pb.PoolCounters) -> PoolCounters:
    return PoolCounters(
        c.num_usable_blocks,
        c.num_free_blocks,
        c.num_cached_free_blocks,
        c.num_in_use_blocks,
        c.num_sequences,
    )


def result_to_pb(r: OpResult) -> pb.OpResult:
    if isinstance(r, GrowResult):
        return pb.OpResult(
            grow=pb.GrowResult(
                statuses=_pb_statuses(r.statuses),
                num_new_blocks=[len(ids) for ids in r.new_block_ids],
                new_block_ids=[b for ids in r.new_block_ids for b in ids],
                copies=[
                    pb.BlockCopy(
                        entry_index=c.entry,
                        block_index=c.block_index,
                        src_block_id=c.src,
                        dst_block_id=c.dst,
                        group=c.group,
                    )
                    for c in r.copies
                ],
                first_live_blocks=r.first_live_blocks,
            )
        )
    if isinstance(r, FreeResult):
        return pb.OpResult(free=pb.FreeResult(num_freed_blocks=r.num_freed_blocks))
    if isinstance(r, CommitResult):
        return pb.OpResult(
            commit=pb.CommitResult(
                status=_pb_status(r.status), num_stored_blocks=r.num_stored_blocks
            )
        )
    if isinstance(r, AdmitResult):
        return pb.OpResult(
            admit=pb.AdmitResult(
                status=_pb_status(r.status),
                block_ids=r.block_ids,
                num_cached_tokens=r.num_cached_tokens,
                num_tokens=r.num_tokens,
            )
        )
    if isinstance(r, SwapOutResult):
        return pb.OpResult(
            swap_out=pb.SwapOutResult(
                statuses=_pb_statuses(r.statuses),
                num_host_slots=[len(s) for s in r.host_slots],
                host_slots=[x for s in r.host_slots for x in s],
                num_freed_blocks=r.num_freed_blocks,
            )
        )
    if isinstance(r, UncacheResult):
        return pb.OpResult(uncache=pb.UncacheResult(num_forgotten=r.num_forgotten))
    if isinstance(r, SwapInResult):
        return pb.OpResult(
            swap_in=pb.SwapInResult(
                statuses=_pb_statuses(r.statuses),
                num_blocks=[len(t) for t in r.block_ids],
                block_ids=[b for t in r.block_ids for b in t],
            )
        )
    return pb.OpResult(
        fork=pb.ForkResult(status=_pb_status(r.status), num_shared_blocks=r.num_shared_blocks)
    )


def _runs(ids: Sequence[int], counts: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """``ids`` cut into consecutive runs of ``counts``."""
    out = []
    pos = 0
    for n in counts:
        out.append(tuple(ids[pos : pos + n]))
        pos += n
    return tuple(out)


_STATUSES = (None, OpStatus.OK, OpStatus.RESOURCE_EXHAUSTED, OpStatus.SKIPPED)
_NO_BLOCKS: tuple[int, ...] = ()


def _status(value: int) -> OpStatus:
    if 0 < value < len(_STATUSES):
        return _STATUSES[value]  # type: ignore[return-value]
    raise ValueError(f"unknown OpStatus {value}")


def result_from_pb(r: pb.OpResult) -> OpResult:
    kind = r.WhichOneof("result")
    if kind == "grow":
        g = r.grow
        ids = list(g.new_block_ids)
        new_ids: list[tuple[int, ...]] = []
        pos = 0
        for n in g.num_new_blocks:  # mostly 0 in decode: share one empty tuple
            if n:
                new_ids.append(tuple(ids[pos : pos + n]))
                pos += n
            else:
                new_ids.append(_NO_BLOCKS)
        return GrowResult(
            tuple(map(_status, g.statuses)),
            tuple(new_ids),
            tuple(
                BlockCopy(c.entry_index, c.block_index, c.src_block_id, c.dst_block_id, c.group)
                for c in g.copies
            ),
            tuple(g.first_live_blocks),
        )
    if kind == "free":
        return FreeResult(r.free.num_freed_blocks)
    if kind == "commit":
        return CommitResult(_status(r.commit.status), r.commit.num_stored_blocks)
    if kind == "admit":
        a = r.admit
        return AdmitResult(_status(a.status), tuple(a.block_ids), a.num_cached_tokens, a.num_tokens)
    if kind == "fork":
        return ForkResult(_status(r.fork.status), r.fork.num_shared_blocks)
    if kind == "swap_out":
        o = r.swap_out
        return SwapOutResult(
            tuple(map(_status, o.statuses)),
            _runs(o.host_slots, o.num_host_slots),
            o.num_freed_blocks,
        )
    if kind == "swap_in":
        i = r.swap_in
        return SwapInResult(tuple(map(_status, i.statuses)), _runs(i.block_ids, i.num_blocks))
    if kind == "uncache":
        return UncacheResult(r.uncache.num_forgotten)
    raise ValueError(f"operation result with no kind: {r!r}")


def step_to_pb(result: StepResult) -> pb.StepResponse:
    return pb.StepResponse(
        results=[result_to_pb(r) for r in result.results],
        counters=counters_to_pb(result.counters),
        offloads=[
            pb.BlockMove(device_block=m.device_block, host_slot=m.host_slot)
            for m in result.offloads
        ],
        onboards=[
            pb.BlockMove(device_block=m.device_block, host_slot=m.host_slot)
            for m in result.onboards
        ],
        spills=[pb.SlotMove(src=m.src, dst=m.dst) for m in result.spills],
        loads=[pb.SlotMove(src=m.src, dst=m.dst) for m in result.loads],
        stores=[pb.SlotMove(src=m.src, dst=m.dst) for m in result.stores],
    )


def step_from_pb(resp: pb.StepResponse) -> StepResult:
    return StepResult(
        tuple(result_from_pb(r) for r in resp.results),
        counters_from_pb(resp.counters),
        tuple(BlockMove(m.device_block, m.host_slot) for m in resp.offloads),
        tuple(BlockMove(m.device_block, m.host_slot) for m in resp.onboards),
        tuple(SlotMove(m.src, m.dst) for m in resp.spills),
        tuple(SlotMove(m.src, m.dst) for m in resp.loads),
        tuple(SlotMove(m.src, m.dst) for m in resp.stores),
    )
