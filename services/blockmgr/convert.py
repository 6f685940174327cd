"""Protobuf <-> domain conversion for the block manager: the only module that knows both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from pagedserve.v1 import blockmgr_pb2 as pb
from services.blockmgr.errors import BlockManagerError, ErrorCode
from services.blockmgr.types import (
    FULL_GROUP,
    Admit,
    AdmitResult,
    AttentionKindName,
    BlockCopy,
    BlockMove,
    Commit,
    CommitResult,
    EvictionPolicyName,
    Fork,
    ForkResult,
    Free,
    FreeResult,
    Grow,
    GrowResult,
    KVCacheGroup,
    KVEvent,
    KVEventKind,
    KVMedium,
    Operation,
    OpResult,
    OpStatus,
    PoolCounters,
    PoolInfo,
    PoolStats,
    RestoredSequence,
    RestoreResult,
    ServiceInfo,
    StepResult,
)

POLICY_TO_PB: dict[EvictionPolicyName, pb.EvictionPolicy] = {
    EvictionPolicyName.LRU: pb.EVICTION_POLICY_LRU,
    EvictionPolicyName.LFU: pb.EVICTION_POLICY_LFU,
    EvictionPolicyName.ARC: pb.EVICTION_POLICY_ARC,
    EvictionPolicyName.S3FIFO: pb.EVICTION_POLICY_S3FIFO,
}
PB_TO_POLICY: dict[int, EvictionPolicyName] = {v: k for k, v in POLICY_TO_PB.items()}
DEFAULT_POLICY = EvictionPolicyName.LRU


def policy_from_pb(value: int, field: str = "eviction_policy") -> EvictionPolicyName:
    """The policy of an enum value (UNSPECIFIED: the default); INVALID_ARGUMENT naming
    ``field`` for a value this implementation does not know."""
    if value == pb.EVICTION_POLICY_UNSPECIFIED:
        return DEFAULT_POLICY
    try:
        return PB_TO_POLICY[value]
    except KeyError:
        raise BlockManagerError(
            ErrorCode.INVALID_ARGUMENT,
            f"{field}: unknown eviction policy {value}; known: "
            f"{sorted(pb.EvictionPolicy.Name(v) for v in PB_TO_POLICY)}",
        ) from None


ATTENTION_TO_PB: dict[AttentionKindName, pb.AttentionKind] = {
    AttentionKindName.FULL: pb.ATTENTION_KIND_FULL,
    AttentionKindName.SLIDING: pb.ATTENTION_KIND_SLIDING,
}
PB_TO_ATTENTION: dict[int, AttentionKindName] = {v: k for k, v in ATTENTION_TO_PB.items()}
PB_TO_ATTENTION[pb.ATTENTION_KIND_UNSPECIFIED] = AttentionKindName.FULL


def groups_to_pb(groups: Sequence[KVCacheGroup], field: str = "groups") -> list[pb.KVCacheGroup]:
    """KV-cache groups as protobuf; INVALID_ARGUMENT naming ``groups[i].kind`` or
    ``groups[i].layers`` for a value protobuf cannot carry."""
    out = []
    for i, g in enumerate(groups):
        try:
            kind = ATTENTION_TO_PB[AttentionKindName(g.kind)]
        except ValueError:
            raise BlockManagerError(
                ErrorCode.INVALID_ARGUMENT, f"{field}[{i}].kind: unknown attention kind {g.kind!r}"
            ) from None
        try:
            out.append(pb.KVCacheGroup(kind=kind, sliding_window=g.sliding_window, layers=g.layers))
        except (ValueError, TypeError) as exc:
            raise BlockManagerError(ErrorCode.INVALID_ARGUMENT, f"{field}[{i}]: {exc}") from None
    return out


def groups_from_pb(
    groups: Sequence[pb.KVCacheGroup], field: str = "groups"
) -> tuple[KVCacheGroup, ...]:
    """Domain groups (UNSPECIFIED kind: FULL); INVALID_ARGUMENT naming ``groups[i].kind`` for a
    kind this implementation does not know."""
    out = []
    for i, g in enumerate(groups):
        try:
            kind = PB_TO_ATTENTION[g.kind]
        except KeyError:
            raise BlockManagerError(
                ErrorCode.INVALID_ARGUMENT,
                f"{field}[{i}].kind: unknown attention kind {g.kind}; known: "
                f"{sorted(pb.AttentionKind.Name(v) for v in ATTENTION_TO_PB.values())}",
            ) from None
        out.append(KVCacheGroup(kind, g.sliding_window, tuple(g.layers)))
    return tuple(out)


# The domain enums (IntEnum) carry the proto's values (checked in tests/test_protos.py):
# handing them over needs no mapping, only a type.
def _pb_status(status: OpStatus) -> pb.OpStatus:
    return cast(pb.OpStatus, status)


def _pb_statuses(statuses: Sequence[OpStatus]) -> Sequence[pb.OpStatus]:
    return cast(Sequence[pb.OpStatus], statuses)


# ---- requests ----------------------------------------------------------------------------


def ops_to_pb(ops: Sequence[Operation]) -> list[pb.Operation]:
    out = []
    for op in ops:
        if isinstance(op, Grow):
            out.append(pb.Operation(grow=pb.GrowOp(seq_ids=op.seq_ids, num_tokens=op.num_tokens)))
        elif isinstance(op, Free):
            out.append(pb.Operation(free=pb.FreeOp(seq_ids=op.seq_ids)))
        elif isinstance(op, Commit):
            out.append(
                pb.Operation(
                    commit=pb.CommitOp(
                        seq_id=op.seq_id, start_block=op.start_block, block_hashes=op.block_hashes
                    )
                )
            )
        elif isinstance(op, Admit):
            out.append(
                pb.Operation(
                    admit=pb.AdmitOp(
                        seq_id=op.seq_id,
                        num_prompt_tokens=op.num_prompt_tokens,
                        max_new_tokens=op.max_new_tokens,
                        block_hashes=op.block_hashes,
                        reserve_blocks=op.reserve_blocks,
                        retention_priority=op.retention_priority,
                    )
                )
            )
        elif isinstance(op, Fork):
            out.append(
                pb.Operation(
                    fork=pb.ForkOp(parent_seq_id=op.parent_seq_id, child_seq_id=op.child_seq_id)
                )
            )
        else:
            raise TypeError(f"not a block manager operation: {op!r}")
    return out


def ops_from_pb(ops: Sequence[pb.Operation]) -> list[Operation]:
    """Domain ops; INVALID_ARGUMENT naming the first operation with no oneof set."""
    out: list[Operation] = []
    for i, op in enumerate(ops):
        kind = op.WhichOneof("op")
        if kind == "grow":
            out.append(Grow(tuple(op.grow.seq_ids), tuple(op.grow.num_tokens)))
        elif kind == "free":
            out.append(Free(tuple(op.free.seq_ids)))
        elif kind == "commit":
            c = op.commit
            out.append(Commit(c.seq_id, c.start_block, tuple(c.block_hashes)))
        elif kind == "admit":
            a = op.admit
            out.append(
                Admit(
                    a.seq_id,
                    a.num_prompt_tokens,
                    a.max_new_tokens,
                    tuple(a.block_hashes),
                    a.reserve_blocks,
                    a.retention_priority,
                )
            )
        elif kind == "fork":
            out.append(Fork(op.fork.parent_seq_id, op.fork.child_seq_id))
        else:
            raise BlockManagerError(ErrorCode.INVALID_ARGUMENT, f"ops[{i}]: no operation set")
    return out


def restored_to_pb(seqs: Sequence[RestoredSequence]) -> list[pb.RestoredSequence]:
    return [
        pb.RestoredSequence(
            seq_id=s.seq_id,
            num_tokens=s.num_tokens,
            block_ids=s.block_ids,
            block_hashes=s.block_hashes,
        )
        for s in seqs
    ]


def restored_from_pb(seqs: Sequence[pb.RestoredSequence]) -> list[RestoredSequence]:
    return [
        RestoredSequence(s.seq_id, s.num_tokens, tuple(s.block_ids), tuple(s.block_hashes))
        for s in seqs
    ]


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
    return pb.OpResult(
        fork=pb.ForkResult(status=_pb_status(r.status), num_shared_blocks=r.num_shared_blocks)
    )


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
    )


def step_from_pb(resp: pb.StepResponse) -> StepResult:
    return StepResult(
        tuple(result_from_pb(r) for r in resp.results),
        counters_from_pb(resp.counters),
        tuple(BlockMove(m.device_block, m.host_slot) for m in resp.offloads),
        tuple(BlockMove(m.device_block, m.host_slot) for m in resp.onboards),
    )


def restore_to_pb(r: RestoreResult) -> pb.RestoreResponse:
    return pb.RestoreResponse(
        num_sequences=r.num_sequences,
        num_stored_blocks=r.num_stored_blocks,
        counters=counters_to_pb(r.counters),
    )


def restore_from_pb(r: pb.RestoreResponse) -> RestoreResult:
    return RestoreResult(r.num_sequences, r.num_stored_blocks, counters_from_pb(r.counters))


def pool_info_to_pb(p: PoolInfo) -> pb.PoolInfo:
    return pb.PoolInfo(
        pool_id=p.pool_id,
        epoch=p.epoch,
        num_blocks=p.num_blocks,
        block_size=p.block_size,
        num_usable_blocks=p.num_usable_blocks,
        enable_prefix_caching=p.enable_prefix_caching,
        eviction_policy=POLICY_TO_PB[p.eviction_policy],
        groups=groups_to_pb(p.groups),
        host_blocks=p.host_blocks,
    )


def pool_info_from_pb(p: pb.PoolInfo) -> PoolInfo:
    return PoolInfo(
        p.pool_id,
        p.epoch,
        p.num_blocks,
        p.block_size,
        p.enable_prefix_caching,
        policy_from_pb(p.eviction_policy),
        groups=groups_from_pb(p.groups) or (FULL_GROUP,),  # none: a server predating groups
        host_blocks=p.host_blocks,
    )


def info_to_pb(i: ServiceInfo) -> pb.BlockManagerInfo:
    return pb.BlockManagerInfo(
        implementation=i.implementation,
        version=i.version,
        hash_algorithm=i.hash_algorithm,
        hash_size_bytes=i.hash_size,
        eviction_policies=[POLICY_TO_PB[p] for p in i.eviction_policies],
        pools=[pool_info_to_pb(p) for p in i.pools],
        max_kv_cache_groups=i.max_kv_cache_groups,
        max_retention_priority=i.max_retention_priority,
    )


def info_from_pb(i: pb.BlockManagerInfo) -> ServiceInfo:
    return ServiceInfo(
        i.implementation,
        i.version,
        i.hash_algorithm,
        i.hash_size_bytes,
        tuple(PB_TO_POLICY[p] for p in i.eviction_policies if p in PB_TO_POLICY),
        tuple(pool_info_from_pb(p) for p in i.pools),
        i.max_kv_cache_groups,
        i.max_retention_priority,
    )


def stats_to_pb(s: PoolStats) -> pb.PoolStats:
    return pb.PoolStats(
        pool=pool_info_to_pb(s.pool),
        counters=counters_to_pb(s.counters),
        prefix_cache_queries_tokens=s.prefix_cache_queries_tokens,
        prefix_cache_hits_tokens=s.prefix_cache_hits_tokens,
        num_evicted_blocks=s.num_evicted_blocks,
        num_cow_copies=s.num_cow_copies,
        num_steps=s.num_steps,
        last_event_seq=s.last_event_seq,
        host_hits_tokens=s.host_hits_tokens,
        num_offloaded_blocks=s.num_offloaded_blocks,
        num_onboarded_blocks=s.num_onboarded_blocks,
        num_host_evicted_blocks=s.num_host_evicted_blocks,
        num_host_cached_blocks=s.num_host_cached_blocks,
        eviction_age_steps=s.eviction_age_steps,
        eviction_reuse=s.eviction_reuse,
    )


def stats_from_pb(s: pb.PoolStats) -> PoolStats:
    return PoolStats(
        pool_info_from_pb(s.pool),
        counters_from_pb(s.counters),
        s.prefix_cache_queries_tokens,
        s.prefix_cache_hits_tokens,
        s.num_evicted_blocks,
        s.num_cow_copies,
        s.num_steps,
        s.last_event_seq,
        s.host_hits_tokens,
        s.num_offloaded_blocks,
        s.num_onboarded_blocks,
        s.num_host_evicted_blocks,
        s.num_host_cached_blocks,
        s.eviction_age_steps,
        s.eviction_reuse,
    )


def events_to_pb(pool_id: str, events: Sequence[KVEvent]) -> pb.KVEventBatch:
    return pb.KVEventBatch(
        pool_id=pool_id,
        events=[
            pb.KVEvent(
                seq=e.seq,
                epoch=e.epoch,
                kind=cast(pb.KVEventKind, e.kind),
                block_hashes=e.block_hashes,
                group=e.group,
                medium=cast(pb.KVMedium, e.medium),
            )
            for e in events
        ],
    )


def events_from_pb(batch: pb.KVEventBatch) -> list[KVEvent]:
    return [
        KVEvent(
            e.seq, e.epoch, KVEventKind(e.kind), tuple(e.block_hashes), e.group, KVMedium(e.medium)
        )
        for e in batch.events
    ]
