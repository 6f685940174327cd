"""KV-cache groups: a pool's groups as registered, and the sliding-window logic (pure, no I/O).

A pool serves :data:`MAX_KV_CACHE_GROUPS` group (one block table per sequence): FULL attention,
where a sequence keeps every block, or SLIDING, where a query at position p reads only the keys
in (p - W, p]. A block wholly before the window of every query still to come is never read
again, so a SLIDING sequence gives it back: its table keeps one entry per block of its slots,
but the entries before its ``first_live`` index are :data:`NULL_BLOCK` and hold no reference.

- :func:`first_live`: the first block the queries from a position on may still read.
- :func:`longest_window_hit`: an admission's prefix hit, which needs only the blocks in the
  window of the first uncached query to be cached.
- :func:`grow_sliding`: a Grow that first releases the blocks out of the window of the entry's
  queries (blocks so freed count for the same entry's allocations).

Eviction order: released blocks enter the pool's eviction order when released, oldest first,
and a freed sequence's last-window blocks only at Free (oldest first too), so a finished
conversation's next turn keeps hitting its whole prefix while its out-of-window blocks are
evicted first (the opposite order collapsed multi-turn hits: vllm-project/vllm#48435).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from services.blockmgr.errors import invalid
from services.blockmgr.types import (
    FULL_GROUP,
    AttentionKindName,
    BlockCopy,
    Grow,
    GrowResult,
    KVCacheGroup,
    OpStatus,
)
from services.common.blocks import NULL_BLOCK, blocks_to_grow, first_live_block, needs_cow

if TYPE_CHECKING:
    from services.blockmgr.kv_manager import KVBlockManager

MAX_KV_CACHE_GROUPS = 1  # groups per pool this implementation serves
MAX_LAYER = 2**31 - 1  # layers travel as int32


def validated_groups(groups: Sequence[KVCacheGroup]) -> tuple[KVCacheGroup, ...]:
    """A pool's groups as it will hold and echo them: ``(FULL_GROUP,)`` for none, kinds
    normalised. INVALID_ARGUMENT naming ``groups`` (too many) or ``groups[i].<field>``."""
    if not groups:
        return (FULL_GROUP,)
    if len(groups) > MAX_KV_CACHE_GROUPS:
        raise invalid(
            f"groups: {len(groups)} KV-cache groups, this block manager serves at most "
            f"{MAX_KV_CACHE_GROUPS} per pool"
        )
    out = []
    for i, group in enumerate(groups):
        where = f"groups[{i}]"
        try:
            kind = AttentionKindName(group.kind)
        except ValueError:
            raise invalid(
                f"{where}.kind: unknown attention kind {group.kind!r}; known: "
                f"{[k.value for k in AttentionKindName]}"
            ) from None
        window = group.sliding_window
        if kind is AttentionKindName.SLIDING and window < 1:
            raise invalid(f"{where}.sliding_window must be >= 1 for a sliding group, got {window}")
        if kind is AttentionKindName.FULL and window != 0:
            raise invalid(f"{where}.sliding_window must be 0 for a full group, got {window}")
        for j, layer in enumerate(group.layers):
            if not 0 <= layer <= MAX_LAYER:
                raise invalid(f"{where}.layers[{j}] must be an int32 >= 0, got {layer}")
        out.append(KVCacheGroup(kind, window, tuple(group.layers)))
    return tuple(out)


def sliding_window_of(groups: Sequence[KVCacheGroup]) -> int:
    """The window of a one-group pool: W for a SLIDING group, 0 (full attention) otherwise."""
    (group,) = groups
    return group.sliding_window if group.kind is AttentionKindName.SLIDING else 0


def longest_window_hit(
    block_hashes: Sequence[bytes],
    window: int,
    block_size: int,
    lookup: Callable[[bytes], int | None],
) -> tuple[int, list[int]]:
    """The longest prefix hit of ``k`` full blocks such that the blocks a query at ``k *
    block_size`` reads, ``first_live_block(k * bs) .. k - 1``, are all matchable (blocks before them
    need not be cached): ``(k, their block ids)``.

    Searched right to left: a miss at block ``j`` rules out every ``k`` in ``(j, k]`` (their
    windows start at or before ``j``), so the next candidate is ``k = j``. Every block is looked
    up at most once: O(len(block_hashes))."""
    found: dict[int, int | None] = {}
    k = len(block_hashes)
    while k > 0:
        lo = first_live_block(k * block_size, window, block_size)
        j = k - 1
        while j >= lo:
            block_id = found.get(j, -1)
            if block_id == -1:
                block_id = found[j] = lookup(block_hashes[j])
            if block_id is None:
                break
            j -= 1
        if j < lo:
            return k, [cast(int, found[i]) for i in range(lo, k)]  # all found: none is None
        k = j
    return 0, []


def grow_sliding(m: KVBlockManager, op: Grow, failed: set[int]) -> GrowResult:
    """:meth:`KVBlockManager._grow` for a SLIDING pool. Each entry first releases the blocks
    before the window of its queries (they start at the sequence's current slot count): their
    entries become 0 and they are decref'd in order, so a block nobody else holds is freed
    (committed: cached-free and matchable) and counts for this entry's allocations. A failed
    or skipped entry releases nothing. ``first_live_blocks`` reports each entry's first_live."""
    pool, bs, window, seqs = m.pool, m.block_size, m.sliding_window, m.seqs
    refcount = pool.refcount
    statuses: list[OpStatus] = []
    new_ids: list[tuple[int, ...]] = []
    copies: list[BlockCopy] = []
    first_lives: list[int] = []
    ok, empty = OpStatus.OK, ()
    for entry, (seq_id, n) in enumerate(zip(op.seq_ids, op.num_tokens, strict=True)):
        if failed and seq_id in failed:  # absent if its admission failed in this step
            skipped = seqs.get(seq_id)
            statuses.append(OpStatus.SKIPPED)
            new_ids.append(empty)
            first_lives.append(skipped.first_live if skipped is not None else 0)
            continue
        state = seqs[seq_id]
        table, old, start = state.block_table, state.num_tokens, state.first_live
        live = max(first_live_block(old, window, bs), start)
        need = blocks_to_grow(old, n, len(table), bs)
        # Never the released blocks: the last block is released only when it is full (W = 1).
        cow = needs_cow(old, n, bs, refcount[table[-1]] if table else 0)
        if live == start and not need and not cow:  # decode inside the last block's room
            state.num_tokens = old + n
            statuses.append(ok)
            new_ids.append(empty)
            first_lives.append(start)
            continue
        if need + cow:
            freed_here = sum(1 for i in range(start, live) if refcount[table[i]] == 1)
            if need + cow > pool.num_free + freed_here:
                failed.add(seq_id)
                statuses.append(OpStatus.RESOURCE_EXHAUSTED)
                new_ids.append(empty)
                first_lives.append(start)
                continue
        for i in range(start, live):  # oldest first: evicted first
            pool.decref(table[i])
            table[i] = NULL_BLOCK
        state.first_live = live
        added = m.extend_table(table, entry, need, cow, copies)
        state.num_tokens = old + n
        statuses.append(ok)
        new_ids.append(added)
        first_lives.append(live)
    return GrowResult(tuple(statuses), tuple(new_ids), tuple(copies), tuple(first_lives))


__all__ = [
    "MAX_KV_CACHE_GROUPS",
    "grow_sliding",
    "longest_window_hit",
    "sliding_window_of",
    "validated_groups",
]
