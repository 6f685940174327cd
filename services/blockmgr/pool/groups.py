"""KV-cache groups: a pool's groups as registered, and the per-group table logic (pure, no I/O).

A pool serves up to :data:`MAX_KV_CACHE_GROUPS` groups (vLLM's hybrid KV-cache manager): each
sequence has one block table per group, all of the same length (one entry per block of its
slots), allocated from the pool's one set of blocks under one eviction order. A block belongs
to one group's tables at a time, and is cached under its hash *in that group*
(:func:`group_key`): the same tokens have different K/V in different layers.

- FULL attention: a sequence keeps every block.
- SLIDING (window W): a query at position p reads only the keys in (p - W, p]. A block wholly
  before the window of every query still to come is never read again, so the sequence gives
  it back: the entries before the group's ``first_live`` index are :data:`NULL_BLOCK` and hold
  no reference.

- :func:`services.common.blocks.first_live_block`: the first block the queries from a
  position on may still read.
- :func:`longest_window_hit`: one sliding group's prefix hit, which needs only the blocks in
  the window of the first uncached query to be cached (searched right to left).
- :func:`longest_group_hit`: an admission's hit across groups: the longest prefix every group
  can serve (a full group scans left to right, a sliding one right to left, until they agree).
- :func:`services.blockmgr.pool.grow.grow`: a Grow that first releases each sliding group's blocks
  out of the window of the entry's queries (blocks so freed count for the same entry's allocations).

Eviction order: released blocks enter the pool's eviction order when released, oldest first,
and a freed sequence's live blocks only at Free (a full group's tail first, a sliding group's
oldest first), so a finished conversation's next turn keeps hitting its whole prefix while its
out-of-window blocks are evicted first (the opposite order collapsed multi-turn hits:
vllm-project/vllm#48435).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar, cast

from services.blockmgr.api.errors import invalid
from services.blockmgr.api.hashing import HASH_SIZE
from services.blockmgr.api.types import (
    FULL_GROUP,
    AttentionKindName,
    KVCacheGroup,
)
from services.common.blocks import first_live_block

MAX_KV_CACHE_GROUPS = 64  # groups per pool this implementation serves
MAX_LAYER = 2**31 - 1  # layers travel as int32
K = TypeVar("K")


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
    owner: dict[int, int] = {}  # layer -> its group
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
            if layer in owner:
                raise invalid(
                    f"{where}.layers[{j}]: layer {layer} is in groups[{owner[layer]}] too"
                )
            owner[layer] = i
        out.append(KVCacheGroup(kind, window, tuple(group.layers)))
    return tuple(out)


def windows_of(groups: Sequence[KVCacheGroup]) -> tuple[int, ...]:
    """Each group's window: W for a SLIDING group, 0 (full attention) for a FULL one."""
    return tuple(g.sliding_window if g.kind is AttentionKindName.SLIDING else 0 for g in groups)


def group_key(block_hash: bytes, group: int) -> bytes:
    """The key a block of ``group`` is cached under: the hash itself in group 0 (so a one-group
    pool's keys are its hashes), the hash and the group's index byte after it otherwise."""
    return block_hash + bytes((group,)) if group else block_hash


def split_key(key: bytes) -> tuple[bytes, int]:
    """``(block hash, group)`` of a :func:`group_key`."""
    if len(key) > HASH_SIZE:
        return key[:HASH_SIZE], key[HASH_SIZE]
    return key, 0


def longest_window_hit(
    block_hashes: Sequence[K],
    window: int,
    block_size: int,
    lookup: Callable[[K], int | None],
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


def longest_group_hit(
    block_hashes: Sequence[bytes],
    windows: Sequence[int],
    block_size: int,
    lookup: Callable[[bytes], int | None],
) -> tuple[int, list[int], list[list[int]]]:
    """The longest prefix hit of ``k`` full blocks that every group can serve: a FULL group
    needs blocks ``0 .. k - 1`` cached under its keys, a SLIDING group only the blocks a query
    at ``k * block_size`` reads. Returns ``(k, first_live per group, the hit block ids per
    group: indices first_live .. k - 1)``.

    Each group in turn lowers ``k`` to the longest hit it serves within ``k``; a sliding hit at
    a smaller ``k`` reads other blocks, so the groups are asked again until none lowers it.
    Lookups are remembered per group, so each key is looked up at most once."""
    num_groups = len(windows)
    found: list[dict[int, int | None]] = [{} for _ in range(num_groups)]

    def lookup_in(group: int) -> Callable[[int], int | None]:
        memo = found[group]

        def get(i: int) -> int | None:
            if i not in memo:
                memo[i] = lookup(group_key(block_hashes[i], group))
            return memo[i]

        return get

    getters = [lookup_in(g) for g in range(num_groups)]
    k = len(block_hashes)
    settled = 0  # groups in a row that served the current k
    g = 0
    while settled < num_groups and k > 0:
        get, window = getters[g], windows[g]
        if window:
            served, _ = longest_window_hit(range(k), window, block_size, get)
        else:
            served = 0
            while served < k and get(served) is not None:
                served += 1
        if served < k:
            k, settled = served, 1
        else:
            settled += 1
        g = (g + 1) % num_groups
    lives = [first_live_block(k * block_size, w, block_size) for w in windows]
    hits = [[cast(int, found[g][i]) for i in range(lives[g], k)] for g in range(num_groups)]
    return k, lives, hits


__all__ = [
    "MAX_KV_CACHE_GROUPS",
    "group_key",
    "longest_group_hit",
    "longest_window_hit",
    "split_key",
    "validated_groups",
    "windows_of",
]
