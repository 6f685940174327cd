"""Eviction policies that keep a memory of what they evicted: ARC and S3-FIFO.

Both order the pool's *cached free* blocks (refcount 0, hash still matchable), as every policy does
(see :mod:`services.blockmgr.eviction.policies`), and both remember the keys of blocks they evicted
(ghosts, at most one per block of the pool), so that content asked for again soon after its eviction
is treated as frequently used from then on. A key is the block's cache key (its hash, and its
KV-cache group in a hybrid pool); the pool tells a policy of every lookup that missed
(:meth:`missed`: a ghost hit for these policies) and of every hash dropped (:meth:`forget`).

- **ARC** (Megiddo & Modha, FAST'03) over the evictable blocks: ``T1`` holds blocks whose
  content was hit at most once, ``T2`` the rest; each is evicted least recently freed first.
  The split adapts: a miss on a key evicted from ``T1`` (ghost list ``B1``) raises ``T1``'s
  target ``p``, one on a key evicted from ``T2`` (``B2``) lowers it. Eviction takes ``T1``'s
  oldest while ``T1`` is above ``p``, else ``T2``'s. vLLM's OffloadingConnector offers ARC for
  its host tier.
- **S3-FIFO** (Yang et al., SOSP'23): a small FIFO ``S`` (new content) and a main FIFO ``M``,
  with a 2-bit use counter per block. A block freed whose content was hit, or whose key is a
  ghost, enters ``M``; other new content enters ``S``. Eviction takes from ``S`` while it holds
  at least a tenth of the evictable blocks (its key becomes a ghost), else from ``M``, where a
  used block goes round once more per use counted. (A free block is never used while queued:
  a hit takes it out, so the counter is of its uses since its hash was stored.) One-hit
  content (a one-off prompt) so leaves quickly without flushing what is reused.

Hits are counted as long as a block keeps its hash, as :class:`~.eviction.LFUPolicy` counts
them. Every operation is O(1) amortised.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

__all__ = ["ARCPolicy", "S3FIFOPolicy"]

KeyOf = Callable[[int], bytes | None]


class _Ghosts:
    """Keys of evicted blocks, oldest dropped first beyond ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def take(self, key: bytes) -> bool:
        """Whether ``key`` was a ghost (it no longer is)."""
        return self._keys.pop(key, 0) is None

    def __len__(self) -> int:
        return len(self._keys)


class ARCPolicy:
    name = "arc"

    def __init__(self, capacity: int, key_of: KeyOf) -> None:
        self.capacity = max(capacity, 1)
        self._key_of = key_of
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1 = _Ghosts(self.capacity)
        self._b2 = _Ghosts(self.capacity)
        self._hits: dict[int, int] = {}
        self.p = 0.0  # target size of T1
        self._evicted_from_t1: dict[int, bool] = {}  # popped, hash not yet dropped

    def push(self, block_id: int) -> None:
        (self._t2 if self._hits.get(block_id, 0) else self._t1)[block_id] = None

    def remove(self, block_id: int) -> None:
        self.discard(block_id)
        self._hits[block_id] = self._hits.get(block_id, 0) + 1

    def discard(self, block_id: int) -> None:
        if self._t1.pop(block_id, 0) is not None:
            self._t2.pop(block_id, None)

    def pop(self) -> int:
        t1, t2 = self._t1, self._t2
        from_t1 = bool(t1) and (len(t1) > self.p or not t2)
        block_id, _ = (t1 if from_t1 else t2).popitem(last=False)
        self._evicted_from_t1[block_id] = from_t1
        return block_id

    def touch(self, block_id: int) -> None:
        self._hits[block_id] = self._hits.get(block_id, 0) + 1

    def forget(self, block_id: int, key: bytes) -> None:
        self._hits.pop(block_id, None)
        from_t1 = self._evicted_from_t1.pop(block_id, None)
        if from_t1 is not None:  # evicted by pop: its key becomes a ghost
            (self._b1 if from_t1 else self._b2).add(key)

    def missed(self, key: bytes) -> None:
        b1, b2 = len(self._b1), len(self._b2)
        if self._b1.take(key):
            self.p = min(self.p + max(1.0, b2 / max(b1, 1)), float(self.capacity))
        elif self._b2.take(key):
            self.p = max(self.p - max(1.0, b1 / max(b2, 1)), 0.0)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._t1 or block_id in self._t2


class S3FIFOPolicy:
    name = "s3fifo"
    SMALL_SHARE = 0.1
    MAX_USES = 3  # S3-FIFO's 2-bit counter

    def __init__(self, capacity: int, key_of: KeyOf) -> None:
        self._key_of = key_of
        self._small: OrderedDict[int, None] = OrderedDict()
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghosts = _Ghosts(max(capacity, 1))
        self._uses: dict[int, int] = {}  # hits while the block kept its hash, capped

    def push(self, block_id: int) -> None:
        key = self._key_of(block_id)
        ghost = key is not None and self._ghosts.take(key)
        (self._main if ghost or self._uses.get(block_id) else self._small)[block_id] = None

    def remove(self, block_id: int) -> None:
        self.discard(block_id)
        self.touch(block_id)

    def discard(self, block_id: int) -> None:
        if self._small.pop(block_id, 0) is not None:
            self._main.pop(block_id, None)

    def pop(self) -> int:
        small, main, uses = self._small, self._main, self._uses
        if small and (len(small) >= self.SMALL_SHARE * len(self) or not main):
            block_id, _ = small.popitem(last=False)  # never hit: a ghost from now on
            key = self._key_of(block_id)
            if key is not None:
                self._ghosts.add(key)
            return block_id
        while True:
            block_id, _ = main.popitem(last=False)
            left = uses.get(block_id, 0)
            if not left:
                return block_id
            uses[block_id] = left - 1  # used: once more round the main queue
            main[block_id] = None

    def touch(self, block_id: int) -> None:
        self._uses[block_id] = min(self._uses.get(block_id, 0) + 1, self.MAX_USES)

    def forget(self, block_id: int, key: bytes) -> None:
        self._uses.pop(block_id, None)

    def missed(self, key: bytes) -> None:
        pass  # a ghost is looked at when a block of that key is freed

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._small or block_id in self._main
