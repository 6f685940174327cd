"""Reuse-class LRU (``reuse``): recency, shifted by how likely each kind of content is to come
back, learnt from the workload as it runs.

On public prefix-cache traces most freed content never returns (on the Mooncake conversation
trace, 76% of blocks at their first use), and how often content has been used already
predicts whether it will be: there, 24% of blocks came back after their first use, 42% after
their second, 88% after their fifth or later, and for content used up to three times after
similar times (medians of 430-500 requests). LRU ignores this, and LFU and ARC give frequency
too much weight where recency matters. So:

- A freed block joins the FIFO of its **class**: how many times its content has been used
  (prefix hits, and computing it again after its eviction), ``0 .. CLASSES - 1`` (capped).
- The policy learns each class's **reuse probability** ``p_c``: of the content freed in that
  class, the share used again within ``HORIZON`` x capacity frees (keys are remembered that
  long, ghosts included; a Laplace prior makes an unseen class 1/2).
- The victim is the oldest block of the class whose ``freed_at + SPAN * capacity * ln p_c``
  is least: its place in an LRU order, moved earlier by ``SPAN`` x capacity frees each time
  its class is e times less likely to come back. Within a class it is LRU, so a chain's tail
  (freed first) still goes before its head; with one class, or equal ``p_c``, it is LRU.

It is the ATC'25 paper's idea (Wang et al., "KVCache Cache in the Wild": reuse is predictable
per category of request, so evict by predicted reuse, not by recency alone), with the
category read from the content's own history, which every pool sees, rather than from a
request type that only some clients send. Every operation is O(CLASSES).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

from services.blockmgr.eviction.adaptive import KeyOf

__all__ = ["ReusePolicy"]


class ReusePolicy:
    name = "reuse"
    CLASSES = 5  # uses 0, 1, 2, 3, 4 or more
    SPAN = 2.0  # capacities of frees that a factor e in reuse probability is worth
    HORIZON = 4  # capacities of frees a freed key is awaited for (its reuse counted)

    def __init__(self, capacity: int, key_of: KeyOf) -> None:
        capacity = max(capacity, 1)
        self._key_of = key_of
        self._span = self.SPAN * capacity
        self._horizon = self.HORIZON * capacity
        self._queues: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(self.CLASSES)]
        self._class_of: dict[int, int] = {}  # queued block -> its class
        self._uses: dict[int, int] = {}  # block -> its content's uses, while it keeps its hash
        self._tick = 0  # frees so far
        self._reused = [1.0] * self.CLASSES  # per class: content used again in the horizon
        self._resolved = [2.0] * self.CLASSES  # ... and content whose outcome is known
        # Freed content awaiting its reuse: key -> (class, tick freed, uses), expiring in order
        # (class -1: reused already, kept for its uses).
        self._awaited: dict[bytes, tuple[int, int, int]] = {}
        self._expiry: deque[tuple[int, bytes]] = deque()

    def push(self, block_id: int) -> None:
        self._tick += 1
        uses = self._uses.get(block_id, 0)
        key = self._key_of(block_id)
        if key is not None:
            earlier = self._awaited.pop(key, None)
            if earlier is not None and earlier[0] >= 0:  # freed before, not hit since: used
                self._count(earlier[0], reused=True)  # again (computed anew after eviction)
                uses = max(uses, earlier[2] + 1)
            elif earlier is not None:  # hit since (maybe in another block: a tier's slot)
                uses = max(uses, earlier[2])
            self._awaited[key] = (min(uses, self.CLASSES - 1), self._tick, uses)
            self._expiry.append((self._tick, key))
        self._uses[block_id] = uses
        cls = min(uses, self.CLASSES - 1)
        self._class_of[block_id] = cls
        self._queues[cls][block_id] = self._tick
        self._expire()

    def remove(self, block_id: int) -> None:
        self.discard(block_id)
        self.touch(block_id)
        key = self._key_of(block_id)
        earlier = self._awaited.get(key) if key is not None else None
        if earlier is not None and key is not None:
            if earlier[0] >= 0:
                self._count(earlier[0], reused=True)
            # Resolved (class -1), the entry keeps the content's uses till its expiry: a tier
            # slot forgets its block's uses when the content moves to the device.
            self._awaited[key] = (-1, earlier[1], self._uses[block_id])

    def discard(self, block_id: int) -> None:
        del self._queues[self._class_of.pop(block_id)][block_id]

    def pop(self) -> int:
        best_cls, best = -1, math.inf
        for cls, queue in enumerate(self._queues):
            if queue:
                freed_at = next(iter(queue.values()))
                rank = freed_at + self._span * math.log(self._reused[cls] / self._resolved[cls])
                if rank < best:
                    best_cls, best = cls, rank
        block_id, _ = self._queues[best_cls].popitem(last=False)
        del self._class_of[block_id]
        return block_id

    def touch(self, block_id: int) -> None:
        self._uses[block_id] = self._uses.get(block_id, 0) + 1

    def forget(self, block_id: int, key: bytes) -> None:
        self._uses.pop(block_id, None)  # (the content's uses stay with its awaited key)

    def missed(self, key: bytes) -> None:
        pass  # an awaited key is looked at when a block of that key is freed

    def reuse_probabilities(self) -> list[float]:
        """Each class's learnt reuse probability (for reports and tests)."""
        return [r / n for r, n in zip(self._reused, self._resolved, strict=True)]

    def _count(self, cls: int, *, reused: bool) -> None:
        self._reused[cls] += reused
        self._resolved[cls] += 1

    def _expire(self) -> None:
        """Content freed more than the horizon ago and not used since: not reused."""
        expiry, awaited, oldest = self._expiry, self._awaited, self._tick - self._horizon
        while expiry and expiry[0][0] <= oldest:
            tick, key = expiry.popleft()
            entry = awaited.get(key)
            if entry is not None and entry[1] == tick:
                del awaited[key]
                if entry[0] >= 0:
                    self._count(entry[0], reused=False)

    def __len__(self) -> int:
        return len(self._class_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._class_of
