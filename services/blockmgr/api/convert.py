"""Protobuf <-> domain conversion for the block manager: the only module that knows both."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

from pagedserve.v1 import blockmgr_pb2 as pb
from services.blockmgr.api.convert_results import (  # re-exported: one module to import
    counters_from_pb,
    counters_to_pb,
)
from services.blockmgr.api.errors import BlockManagerError, ErrorCode
from services.blockmgr.api.types import (
    FULL_GROUP,
    OP_NAMES,
    OP_TYPES,
    AttentionKindName,
    EvictionPolicyName,
    KVCacheGroup,
    KVEvent,
    KVEventKind,
    KVMedium,
    Operation,
    PoolInfo,
    PoolSpec,
    PoolStats,
    RestoredSequence,
    RestoreResult,
    ServiceInfo,
)

POLICY_TO_PB: dict[EvictionPolicyName, pb.EvictionPolicy] = {
    EvictionPolicyName.LRU: pb.EVICTION_POLICY_LRU,
    EvictionPolicyName.LFU: pb.EVICTION_POLICY_LFU,
    EvictionPolicyName.ARC: pb.EVICTION_POLICY_ARC,
    EvictionPolicyName.S3FIFO: pb.EVICTION_POLICY_S3FIFO,
    EvictionPolicyName.REUSE: pb.EVICTION_POLICY_REUSE,
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


# ---- requests ----------------------------------------------------------------------------


# Per operation name: its proto message class and the names of its fields (the dataclass's).
_OP_MESSAGES: dict[str, tuple[Any, tuple[str, ...]]] = {
    name: (
        getattr(pb, pb.Operation.DESCRIPTOR.fields_by_name[name].message_type.name),
        tuple(f.name for f in dataclasses.fields(cls)),
    )
    for cls, name in OP_NAMES.items()
}


def ops_to_pb(ops: Sequence[Operation]) -> list[pb.Operation]:
    out = []
    for op in ops:
        name = OP_NAMES.get(type(op))
        if name is None:
            raise TypeError(f"not a block manager operation: {op!r}")
        message, fields = _OP_MESSAGES[name]
        out.append(pb.Operation(**{name: message(**{f: getattr(op, f) for f in fields})}))
    return out


def ops_from_pb(ops: Sequence[pb.Operation]) -> list[Operation]:
    """Domain ops; INVALID_ARGUMENT naming the first operation with no oneof set."""
    out: list[Operation] = []
    for i, op in enumerate(ops):
        name = op.WhichOneof("op")
        if name is None or name not in OP_TYPES:
            raise BlockManagerError(ErrorCode.INVALID_ARGUMENT, f"ops[{i}]: no operation set")
        message = getattr(op, name)
        values = {f: _from_pb_value(getattr(message, f)) for f in _OP_MESSAGES[name][1]}
        out.append(OP_TYPES[name](**values))
    return out


def _from_pb_value(value: Any) -> Any:
    """A scalar as is; a repeated field as a tuple."""
    return value if isinstance(value, int | float | bytes | str) else tuple(value)


def restored_to_pb(seqs: Sequence[RestoredSequence]) -> list[pb.RestoredSequence]:
    return [
        pb.RestoredSequence(
            seq_id=s.seq_id,
            num_tokens=s.num_tokens,
            block_ids=s.block_ids,
            block_hashes=s.block_hashes,
            host_slots=s.host_slots,
            num_lookahead=s.num_lookahead,
        )
        for s in seqs
    ]


def restored_from_pb(seqs: Sequence[pb.RestoredSequence]) -> list[RestoredSequence]:
    return [
        RestoredSequence(
            s.seq_id,
            s.num_tokens,
            tuple(s.block_ids),
            tuple(s.block_hashes),
            tuple(s.host_slots),
            s.num_lookahead,
        )
        for s in seqs
    ]


def restore_to_pb(r: RestoreResult) -> pb.RestoreResponse:
    return pb.RestoreResponse(
        num_sequences=r.num_sequences,
        num_stored_blocks=r.num_stored_blocks,
        counters=counters_to_pb(r.counters),
    )


def restore_from_pb(r: pb.RestoreResponse) -> RestoreResult:
    return RestoreResult(r.num_sequences, r.num_stored_blocks, counters_from_pb(r.counters))


def register_to_pb(pool_id: str, spec: PoolSpec, owner_token: str) -> pb.RegisterPoolRequest:
    """A Register request; INVALID_ARGUMENT naming a policy that is none of the contract's."""
    try:
        policy = POLICY_TO_PB[EvictionPolicyName.parse(spec.eviction_policy)]
        tier_policy = POLICY_TO_PB[EvictionPolicyName.parse(spec.tier_eviction_policy)]
    except ValueError as exc:
        raise BlockManagerError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
    return pb.RegisterPoolRequest(
        pool_id=pool_id,
        num_blocks=spec.num_blocks,
        block_size=spec.block_size,
        enable_prefix_caching=spec.enable_prefix_caching,
        eviction_policy=policy,
        owner_token=owner_token,
        groups=groups_to_pb(spec.groups),
        host_blocks=spec.host_blocks,
        disk_blocks=spec.disk_blocks,
        tier_eviction_policy=tier_policy,
        prefix_hit_margin=spec.prefix_hit_margin,
        pin_budget_blocks=spec.pin_budget_blocks,
        kv_cache_dtype=spec.kv_cache_dtype,
        kv_scales=spec.kv_scales,
    )


def spec_from_pb(r: pb.RegisterPoolRequest) -> PoolSpec:
    return PoolSpec(
        r.num_blocks,
        r.block_size,
        r.enable_prefix_caching,
        policy_from_pb(r.eviction_policy),
        groups_from_pb(r.groups),
        r.host_blocks,
        r.disk_blocks,
        policy_from_pb(r.tier_eviction_policy, "tier_eviction_policy"),
        r.prefix_hit_margin,
        r.pin_budget_blocks,
        r.kv_cache_dtype,
        r.kv_scales,
    )


def pool_info_to_pb(p: PoolInfo) -> pb.PoolInfo:
    return pb.PoolInfo(
        pool_id=p.pool_id,
        epoch=p.epoch,
        num_blocks=p.num_blocks,
        block_size=p.block_size,
        num_usable_blocks=p.num_usable_blocks,
        enable_prefix_caching=p.enable_prefix_caching,
        eviction_policy=POLICY_TO_PB[EvictionPolicyName(p.eviction_policy)],
        groups=groups_to_pb(p.groups),
        host_blocks=p.host_blocks,
        disk_blocks=p.disk_blocks,
        tier_eviction_policy=POLICY_TO_PB[EvictionPolicyName(p.tier_eviction_policy)],
        prefix_hit_margin=p.prefix_hit_margin,
        pin_budget_blocks=p.pin_budget_blocks,
        kv_cache_dtype=p.kv_cache_dtype,
        kv_scales=p.kv_scales,
    )


def pool_info_from_pb(p: pb.PoolInfo) -> PoolInfo:
    spec = PoolSpec(
        p.num_blocks,
        p.block_size,
        p.enable_prefix_caching,
        policy_from_pb(p.eviction_policy),
        groups_from_pb(p.groups) or (FULL_GROUP,),  # none: a server predating groups
        p.host_blocks,
        p.disk_blocks,
        policy_from_pb(p.tier_eviction_policy, "tier_eviction_policy"),
        p.prefix_hit_margin,
        p.pin_budget_blocks,
        p.kv_cache_dtype,
        p.kv_scales,
    )
    return PoolInfo.of(p.pool_id, p.epoch, spec)


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
        num_swapped_out_blocks=s.num_swapped_out_blocks,
        num_swapped_in_blocks=s.num_swapped_in_blocks,
        num_swapped_sequences=s.num_swapped_sequences,
        disk_hits_tokens=s.disk_hits_tokens,
        num_spilled_blocks=s.num_spilled_blocks,
        num_loaded_blocks=s.num_loaded_blocks,
        num_disk_cached_blocks=s.num_disk_cached_blocks,
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
        s.num_swapped_out_blocks,
        s.num_swapped_in_blocks,
        s.num_swapped_sequences,
        s.disk_hits_tokens,
        s.num_spilled_blocks,
        s.num_loaded_blocks,
        s.num_disk_cached_blocks,
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
