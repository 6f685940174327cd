"""Eviction policies: the order in which free blocks that still hold a cached hash are reused.

A policy only sees *cached* free blocks (refcount 0, hash still matchable). Free blocks without
a hash are always reused first by the pool: they carry nothing worth keeping.

Contract: ``push`` when a cached block's refcount drops to 0, ``remove`` when a prefix hit takes
it back, ``pop`` to choose a victim, ``touch`` when an in-use block is hit (for policies that
count use), ``discard`` to take a block out without counting a hit (a demotion, a restore),
``forget`` when a block's hash is dropped (it was evicted, or a restore took it),
``missed`` when a lookup found no block for a key (for policies with ghosts:
:mod:`services.blockmgr.eviction.adaptive`). Every method is O(1) amortised or O(log n).

Order of entry: a block is pushed when its refcount drops to 0. Full-attention pools free a
sequence tail first. Sliding-window pools push a sequence's blocks as they fall out of its
window (at Grow, oldest first) and its last-window blocks only at Free (oldest first too): so a
sequence's out-of-window blocks are evicted before the last-window blocks that a hit of its
whole history (a conversation's next turn) needs; the reverse order made multi-turn hits
collapse in vLLM (vllm-project/vllm#48435).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Protocol

from services.blockmgr.api.types import EvictionPolicyName
from services.blockmgr.eviction.adaptive import ARCPolicy, KeyOf, S3FIFOPolicy
from services.blockmgr.eviction.reuse import ReusePolicy


class EvictionPolicy(Protocol):
    name: str

    def push(self, block_id: int) -> None: ...
    def remove(self, block_id: int) -> None: ...
    def discard(self, block_id: int) -> None: ...
    def pop(self) -> int: ...
    def touch(self, block_id: int) -> None: ...
    def forget(self, block_id: int, key: bytes) -> None: ...
    def missed(self, key: bytes) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, block_id: int) -> bool: ...


class LRUPolicy:
    """Least recently freed first. Full-attention pools free a sequence's blocks tail first, so
    within one chain the tail is evicted before the head (the head is the most shareable part).
    In a sliding-window pool a sequence's blocks released out of its window are evicted before
    its last-window blocks, which are pushed only at Free (then oldest first)."""

    name = "lru"

    def __init__(self) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict()

    def push(self, block_id: int) -> None:
        self._queue[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]

    def discard(self, block_id: int) -> None:
        del self._queue[block_id]

    def pop(self) -> int:
        block_id, _ = self._queue.popitem(last=False)
        return block_id

    def touch(self, block_id: int) -> None:
        pass

    def forget(self, block_id: int, key: bytes) -> None:
        pass

    def missed(self, key: bytes) -> None:
        pass

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._queue


class LFUPolicy:
    """Fewest prefix hits first, ties broken least recently freed first.

    Hit counts live as long as the block keeps its hash (``forget`` resets them on reuse), so a
    system prompt shared by many requests outlives one-off prompts under memory pressure, where
    LRU would evict it if it went idle for a while.

    Sliding-window pools: ties are broken by push time, and a sequence's blocks released out of
    its window are pushed before its last-window blocks (pushed at Free), so among blocks of
    equal hit counts the out-of-window ones are evicted first. Hits still come first: an
    out-of-window block hit more often than the last window outlives it.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int]] = []
        self._entry: dict[int, tuple[int, int, int]] = {}
        self._hits: dict[int, int] = {}
        self._tick = itertools.count()

    def push(self, block_id: int) -> None:
        entry = (self._hits.get(block_id, 0), next(self._tick), block_id)
        self._entry[block_id] = entry
        heapq.heappush(self._heap, entry)

    def remove(self, block_id: int) -> None:
        self.discard(block_id)
        self._hits[block_id] = self._hits.get(block_id, 0) + 1

    def discard(self, block_id: int) -> None:
        del self._entry[block_id]  # lazily deleted from the heap...
        if len(self._heap) > 2 * len(self._entry) + 64:  # ...which is rebuilt before the
            self._heap = list(self._entry.values())  # stale entries outnumber live ones
            heapq.heapify(self._heap)

    def pop(self) -> int:
        while True:
            entry = heapq.heappop(self._heap)
            if self._entry.get(entry[2]) is entry:
                del self._entry[entry[2]]
                return entry[2]

    def touch(self, block_id: int) -> None:
        self._hits[block_id] = self._hits.get(block_id, 0) + 1

    def forget(self, block_id: int, key: bytes) -> None:
        self._hits.pop(block_id, None)

    def missed(self, key: bytes) -> None:
        pass

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._entry


def make_policy(
    name: EvictionPolicyName | str, capacity: int = 0, key_of: KeyOf = lambda _: None
) -> EvictionPolicy:
    """A new policy of ``name`` for a pool of ``capacity`` blocks whose cache keys ``key_of``
    gives; ``ValueError`` naming the choices for an unknown name."""
    policy = EvictionPolicyName.parse(name)
    if policy is EvictionPolicyName.LRU:
        return LRUPolicy()
    if policy is EvictionPolicyName.LFU:
        return LFUPolicy()
    if policy is EvictionPolicyName.ARC:
        return ARCPolicy(capacity, key_of)
    if policy is EvictionPolicyName.REUSE:
        return ReusePolicy(capacity, key_of)
    return S3FIFOPolicy(capacity, key_of)
