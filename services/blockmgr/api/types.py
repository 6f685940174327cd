"""Domain types of the block manager: operations, results, counters, events.

These are what the core and both clients speak; protobuf appears only in
:mod:`services.blockmgr.api.convert`, at the gRPC edge.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields

from services.common.blocks import usable_blocks


class EvictionPolicyName(enum.StrEnum):
    """The eviction policies of the contract (the proto's ``EvictionPolicy``)."""

    LRU = "lru"
    LFU = "lfu"
    ARC = "arc"
    S3FIFO = "s3fifo"
    REUSE = "reuse"

    @classmethod
    def parse(cls, value: str) -> EvictionPolicyName:
        """``value`` as a policy; ``ValueError`` naming the choices if it is none."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"eviction_policy {value!r} is not one of {[p.value for p in cls]}"
            ) from None


class AttentionKindName(enum.StrEnum):
    """The attention of a KV-cache group's layers (the proto's ``AttentionKind``)."""

    FULL = "full"  # a query reads every earlier key: a sequence keeps all its blocks
    SLIDING = "sliding"  # a query at p reads the keys in (p - W, p]: older blocks are released


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Model layers sharing one block table per sequence (the proto's ``KVCacheGroup``).

    ``sliding_window``: W tokens (>= 1) for a SLIDING group, 0 for a FULL one. ``layers``: the
    model layers the group covers; informational, echoed back in ``PoolInfo.groups``. A pool
    has at most ``ServiceInfo.max_kv_cache_groups`` groups."""

    kind: AttentionKindName = AttentionKindName.FULL
    sliding_window: int = 0
    layers: tuple[int, ...] = ()


FULL_GROUP = KVCacheGroup()  # what a pool registered without groups has


class OpStatus(enum.IntEnum):
    """Per-operation outcome inside an accepted Step (values match the proto enum)."""

    OK = 1
    RESOURCE_EXHAUSTED = 2  # not enough free blocks: nothing was allocated for this entry
    SKIPPED = 3  # an earlier op on the same sequence failed in this step: nothing changed


# Initial metadata a StreamEvents server sends once subscribed (before any event).
EVENTS_LIVE_HEADER = "x-pagedserve-events"


class KVMedium(enum.IntEnum):
    DEVICE = 0  # the executor's device pool (the KV cache)
    HOST = 1  # the pool's host tier
    DISK = 2  # the pool's disk tier


class KVEventKind(enum.IntEnum):
    STORED = 1  # a block hash became matchable
    REMOVED = 2  # a cached block was reused: its hash is no longer matchable
    CLEARED = 3  # the pool was (re)registered: every hash of the previous epoch is gone


@dataclass(frozen=True, slots=True)
class Admit:
    """Admit a new sequence: reuse the longest run of committed blocks matching ``block_hashes``
    (never covering the last prompt token), then allocate slots for up to ``max_new_tokens``
    more prompt tokens. All or nothing; fails unless ``reserve_blocks`` stay free afterwards.
    ``retention_priority``: the blocks it hits or commits are evicted after lower-priority
    ones once free, for a bounded time (:mod:`services.blockmgr.eviction.retention`).
    ``pin_ttl_s``: once free, they are pinned that many seconds, within the pool's pin budget
    (a session pin, :mod:`services.blockmgr.eviction.pins`; 0: none)."""

    seq_id: int
    num_prompt_tokens: int
    max_new_tokens: int
    block_hashes: tuple[bytes, ...] = ()
    reserve_blocks: int = 0
    retention_priority: int = 0
    pin_ttl_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Grow:
    """Append ``num_tokens[i]`` token slots to ``seq_ids[i]``; each entry all or nothing.

    ``num_lookahead[i]`` (speculative decoding; empty: 0 for every entry): slots the sequence
    holds *beyond* its tokens after the grow, for draft tokens not verified yet. Its tokens
    (``num_tokens``) count verified tokens only: only blocks made entirely of them can be
    committed, and a sliding window releases by them. Slots are never given back by a grow:
    the sequence holds ``max(its slots before, its tokens after + num_lookahead[i])`` slots,
    and rejected drafts' slots are simply written again by the next step."""

    seq_ids: tuple[int, ...]
    num_tokens: tuple[int, ...]
    num_lookahead: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Fork:
    """``child_seq_id`` gets ``parent_seq_id``'s table, sharing every block (refcount + 1)."""

    parent_seq_id: int
    child_seq_id: int


@dataclass(frozen=True, slots=True)
class Free:
    """Release the sequences' blocks: group by group, a full group's tail first, a sliding
    group's oldest first (null entries skipped)."""

    seq_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Commit:
    """Blocks ``start_block .. start_block + len(block_hashes) - 1`` of the sequence are full and
    their forward succeeded: make them matchable under these chained hashes."""

    seq_id: int
    start_block: int
    block_hashes: tuple[bytes, ...]


# In a swapped-out sequence's host slots: a null entry (released out of a sliding window).
NO_SLOT = -1


@dataclass(frozen=True, slots=True)
class SwapOut:
    """Preemption by swapping (a pool with a host tier): each sequence's blocks are copied to
    host slots held for it, then its device blocks are released as a Free releases them. The
    sequence stays, swapped out, until :class:`SwapIn` or Free."""

    seq_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SwapIn:
    """Swapped-out sequences come back: device blocks filled from their host slots."""

    seq_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Uncache:
    """Moves of earlier Steps failed: these device blocks and tier slots do not hold what
    the pool has them cached as; the keys they are cached under are forgotten."""

    device_blocks: tuple[int, ...] = ()
    host_slots: tuple[int, ...] = ()
    disk_slots: tuple[int, ...] = ()


Operation = Admit | Grow | Fork | Free | Commit | SwapOut | SwapIn | Uncache

# Each operation's name: its field in the proto's ``Operation`` oneof (whose message has the
# dataclass's fields, same names, same order) and its key in recorded traces. Conversions to
# and from protobuf and trace records walk the dataclass's fields: a new operation is a
# dataclass here, its line in this table, its message in the proto, its check
# (:mod:`services.blockmgr.pool.checks`) and its handler (:mod:`services.blockmgr.pool.manager`).
OP_NAMES: dict[type[Operation], str] = {
    Admit: "admit",
    Grow: "grow",
    Fork: "fork",
    Free: "free",
    Commit: "commit",
    SwapOut: "swap_out",
    SwapIn: "swap_in",
    Uncache: "uncache",
}
OP_TYPES: dict[str, type[Operation]] = {name: cls for cls, name in OP_NAMES.items()}


@dataclass(frozen=True, slots=True)
class AdmitResult:
    status: OpStatus
    block_ids: tuple[int, ...] = ()  # the sequence's tables, group-major
    num_cached_tokens: int = 0
    num_tokens: int = 0  # token slots the sequence holds: cached + newly allocated


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy-on-write: the executor copies ``src`` to ``dst`` before the forward; ``dst``
    replaces ``src`` at ``block_index`` in the table of KV-cache group ``group`` of grow entry
    ``entry``."""

    entry: int
    block_index: int
    src: int
    dst: int
    group: int = 0


@dataclass(frozen=True, slots=True)
class GrowResult:
    statuses: tuple[OpStatus, ...]
    # Per entry, its new blocks: G equal runs, group-major, each appended to that group's table.
    new_block_ids: tuple[tuple[int, ...], ...]
    copies: tuple[BlockCopy, ...] = ()
    # Pools with a SLIDING group: per entry and group (entry-major), the index of the table's
    # first non-null block after the entry (the entries before it are 0: released out of the
    # window; always 0 in a FULL group). Empty when no group slides.
    first_live_blocks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ForkResult:
    status: OpStatus
    num_shared_blocks: int = 0  # the parent's non-null entries, now shared


@dataclass(frozen=True, slots=True)
class FreeResult:
    num_freed_blocks: int


@dataclass(frozen=True, slots=True)
class CommitResult:
    status: OpStatus
    num_stored_blocks: int = 0


@dataclass(frozen=True, slots=True)
class SwapOutResult:
    statuses: tuple[OpStatus, ...]
    host_slots: tuple[tuple[int, ...], ...]  # per entry: the slots holding its table, in order
    num_freed_blocks: int = 0


@dataclass(frozen=True, slots=True)
class SwapInResult:
    statuses: tuple[OpStatus, ...]
    block_ids: tuple[tuple[int, ...], ...]  # per entry: its table (empty unless OK)


@dataclass(frozen=True, slots=True)
class UncacheResult:
    num_forgotten: int  # cached keys forgotten, on the device and in the tiers


OpResult = (
    AdmitResult
    | GrowResult
    | ForkResult
    | FreeResult
    | CommitResult
    | SwapOutResult
    | SwapInResult
    | UncacheResult
)


@dataclass(frozen=True, slots=True)
class PoolCounters:
    num_usable_blocks: int
    num_free_blocks: int  # allocatable now, cached-free included
    num_cached_free_blocks: int
    num_in_use_blocks: int
    num_sequences: int


@dataclass(frozen=True, slots=True)
class BlockMove:
    """A move between a pool's device blocks and its host tier's slots (the executor's host
    memory); which way depends on the list it comes in (:class:`StepResult`)."""

    device_block: int
    host_slot: int


@dataclass(frozen=True, slots=True)
class SlotMove:
    """A move between tiers below the device: host slot ``src`` to disk slot ``dst`` (a spill);
    or, for a load, disk slot ``src`` into device block ``dst``."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class StepResult:
    results: tuple[OpResult, ...]
    counters: PoolCounters
    # The tiers' moves, to perform before the forward in this order: spills (host slot to
    # disk slot, before the host slot is reused), offloads (device blocks copied down before
    # their reuse), onboards (device blocks filled from the host tier), loads (device blocks
    # filled from the disk tier).
    offloads: tuple[BlockMove, ...] = ()
    onboards: tuple[BlockMove, ...] = ()
    spills: tuple[SlotMove, ...] = ()
    loads: tuple[SlotMove, ...] = ()
    # Offloads sent straight to the disk tier (device block src -> disk slot dst), made after
    # the offloads and before the onboards: the host tier had no other slot in the Step.
    stores: tuple[SlotMove, ...] = ()


@dataclass(frozen=True, slots=True)
class RestoredSequence:
    """A live sequence's tables to rebuild, group-major in ``block_ids``. A SLIDING group's
    table may start with a run of 0 (its entries released out of the window);
    ``block_hashes[i]`` names block ``i`` of every table and the hashes of null entries are
    skipped. A swapped-out sequence has no ``block_ids`` but ``host_slots``: the host-tier
    slots its table was swapped to (the executor still holds their content)."""

    seq_id: int
    num_tokens: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...] = ()  # hashes of its first committed full blocks
    host_slots: tuple[int, ...] = ()
    # Slots held beyond its tokens (a grow's lookahead): its tables cover
    # num_tokens + num_lookahead slots.
    num_lookahead: int = 0

    @property
    def num_slots(self) -> int:
        return self.num_tokens + self.num_lookahead


@dataclass(frozen=True, slots=True)
class RestoreResult:
    num_sequences: int
    num_stored_blocks: int
    counters: PoolCounters


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What a pool is: everything ``Register`` carries but the pool's id and its owner token.
    One type for the client protocol, both clients, the core, the trace and the executor: a
    new pool attribute is a field here (and in the proto's ``RegisterPoolRequest`` and
    ``PoolInfo``, and :mod:`services.blockmgr.api.convert`).

    ``groups``: the pool's KV-cache groups (none: one full-attention group); at most
    ``ServiceInfo.max_kv_cache_groups``. ``host_blocks``: slots of a host tier (0: none);
    ``disk_blocks``: slots of a disk tier below it (0: none); ``tier_eviction_policy``: the
    order in which the tiers reuse slots. Policies may be given by name; the block manager
    refuses an unknown one (INVALID_ARGUMENT). ``prefix_hit_margin``: blocks (>= 0) an
    admission's prefix hit stops short of the matched run (EAGLE speculative decoding: a
    draft head's KV at a block's last position depends on the next token, so the last
    matched block is recomputed); a run of n blocks hits ``max(0, n - margin)`` at most.
    ``pin_budget_blocks``: free blocks session pins may keep at once (0: pins are off; at most
    the usable blocks). ``kv_cache_dtype`` and ``kv_scales``: what the blocks' K/V are stored
    in (e.g. ``float8_e4m3fn``) and a digest of the per-layer scales they are stored under
    (both empty: unstated), recorded as the pool's identity (a re-registration is a new epoch
    whatever changed, so no block of one is ever served as the other's)."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    eviction_policy: EvictionPolicyName | str = EvictionPolicyName.LRU
    groups: tuple[KVCacheGroup, ...] = ()
    host_blocks: int = 0
    disk_blocks: int = 0
    tier_eviction_policy: EvictionPolicyName | str = EvictionPolicyName.LRU
    prefix_hit_margin: int = 0
    pin_budget_blocks: int = 0
    kv_cache_dtype: str = ""
    kv_scales: str = ""

    @property
    def num_usable_blocks(self) -> int:
        return usable_blocks(self.num_blocks)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolInfo(PoolSpec):
    """A registered pool: its spec as the block manager holds it (policies parsed, ``groups``
    validated: one FULL group when none was given), its id and its current epoch."""

    pool_id: str
    epoch: int
    # Set only in Register's answer, for the registering owner: the token every later Step,
    # Restore, Unregister and re-Register of the pool must carry, and how long the pool lives
    # without a call from its owner (0: forever).
    owner_token: str = field(default="", repr=False, compare=False)
    lease_s: float = field(default=0.0, compare=False)

    @classmethod
    def of(cls, pool_id: str, epoch: int, spec: PoolSpec) -> PoolInfo:
        """``spec`` (already parsed and validated) registered as ``pool_id`` at ``epoch``."""
        fields = {name: getattr(spec, name) for name in _SPEC_FIELDS}
        return cls(pool_id=pool_id, epoch=epoch, **fields)

    @property
    def spec(self) -> PoolSpec:
        return PoolSpec(**{name: getattr(self, name) for name in _SPEC_FIELDS})


_SPEC_FIELDS = tuple(f.name for f in fields(PoolSpec))


@dataclass(frozen=True, slots=True)
class ServiceInfo:
    implementation: str
    version: str
    hash_algorithm: str
    hash_size: int
    eviction_policies: tuple[EvictionPolicyName, ...]
    pools: tuple[PoolInfo, ...] = ()
    # KV-cache groups per pool the implementation serves; 0: it predates groups (FULL only).
    max_kv_cache_groups: int = 0
    # The highest AdmitOp.retention_priority served; 0: an implementation without them.
    max_retention_priority: int = 0


@dataclass(frozen=True, slots=True)
class PoolStats:
    pool: PoolInfo
    counters: PoolCounters
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    num_evicted_blocks: int
    num_cow_copies: int
    num_steps: int
    last_event_seq: int
    # The host tier: prompt tokens served from it at admission (also in hits_tokens), blocks
    # moved down and up, slots reused for other content, slots holding a block now.
    host_hits_tokens: int = 0
    num_offloaded_blocks: int = 0
    num_onboarded_blocks: int = 0
    num_host_evicted_blocks: int = 0
    num_host_cached_blocks: int = 0
    # Over the blocks evicted from the device: the Steps they had spent free, and the prefix
    # hits their content served, summed (divide by num_evicted_blocks for the means).
    eviction_age_steps: int = 0
    eviction_reuse: int = 0
    # Preemption by swapping: blocks copied to the host and back, sequences swapped out now.
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_swapped_sequences: int = 0
    # The disk tier: prompt tokens loaded from it at admission (also in hits_tokens), blocks
    # spilled into it from the host tier, loaded from it, slots holding a block now.
    disk_hits_tokens: int = 0
    num_spilled_blocks: int = 0
    num_loaded_blocks: int = 0
    num_disk_cached_blocks: int = 0


# (kind, cache key: the block hash, and its group's byte after it in groups > 0): a plain
# tuple, made per block.
PendingEvent = tuple[KVEventKind, bytes]


@dataclass(frozen=True, slots=True)
class KVEvent:
    seq: int  # strictly increasing per pool id, across epochs
    epoch: int
    kind: KVEventKind
    block_hashes: tuple[bytes, ...] = field(default=())
    group: int = 0  # the KV-cache group of the hashes (its index in PoolInfo.groups)
    medium: KVMedium = KVMedium.DEVICE  # where: the device pool, or the host tier
