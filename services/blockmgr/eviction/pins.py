"""Session pins: a request's ask that its blocks be kept for ``T`` seconds after it ends (an
agent session's next turn will hit them; Anthropic's ``cache_control`` TTL, vLLM's session
hints, SGLang's TTL pins), layered over the pool's eviction order.

A block the sequence hits or commits takes the longest TTL any sequence asked for it. When it
is freed it is *pinned* until ``now + TTL`` (or a later end another pin gave it): evicted after
every unpinned free block, in the order it was pinned. A hit takes it out while in use; freed
again before its end, it is pinned again. A pin ends at its time (the block then enters its
retention level as if freed then) or, oldest first, when more blocks are pinned than the
pool's ``budget``. A pinned block is still free: the pool hands it out
when it has no other block to give (the budget shrinks to what the pool can spare), so pins
never refuse an admission or preempt a sequence, and the executor's free-block count is the
pool's.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable

from services.blockmgr.eviction.retention import RetentionLevels

__all__ = ["MAX_PIN_TTL_S", "SessionPins"]

MAX_PIN_TTL_S = 86_400.0  # a day: longer is INVALID_ARGUMENT


class SessionPins:
    """The pool's eviction order: pinned free blocks after the :class:`RetentionLevels`."""

    def __init__(
        self,
        levels: RetentionLevels,
        budget: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.levels = levels
        self.budget = budget
        self.clock = clock
        self.ttl: dict[int, float] = {}  # in-use block -> the TTL it is pinned for once free
        self.until: dict[int, float] = {}  # block -> when its pin ends (free or hit since)
        self.pinned: OrderedDict[int, float] = OrderedDict()  # free block -> until, pin order
        self._ends: list[tuple[float, int]] = []  # heap of (until, block); stale entries skipped

    # ---- what the pool asks ---------------------------------------------------------------

    def pin(self, block_id: int, ttl_s: float) -> None:
        """An in-use block is to be kept ``ttl_s`` seconds once freed (the longest asked)."""
        if ttl_s > self.ttl.get(block_id, 0.0) and self.budget:
            self.ttl[block_id] = ttl_s

    def push(self, block_id: int) -> None:
        ttl = self.ttl.pop(block_id, 0.0) if self.ttl else 0.0
        until = self.until.get(block_id, 0.0) if self.until else 0.0
        if not ttl and not until:
            self.levels.push(block_id)
            return
        now = self.clock()
        if ttl and now + ttl > until:
            until = self.until[block_id] = now + ttl
            heapq.heappush(self._ends, (until, block_id))
        if until <= now:  # a pin that ended while the block was in use
            del self.until[block_id]
            self.levels.push(block_id)
            return
        self.pinned[block_id] = until
        while len(self.pinned) > self.budget:
            oldest, _ = self.pinned.popitem(last=False)
            del self.until[oldest]
            self.levels.push(oldest)

    def remove(self, block_id: int) -> None:
        if self.pinned.pop(block_id, None) is None:
            self.levels.remove(block_id)

    def discard(self, block_id: int) -> None:
        if self.pinned.pop(block_id, None) is None:
            self.levels.discard(block_id)

    def pop(self) -> int:
        if len(self.levels) or not self.pinned:
            return self.levels.pop()
        block_id, _ = self.pinned.popitem(last=False)
        del self.until[block_id]
        return block_id

    def clear(self, block_id: int) -> None:
        """A block handed out again: its content, and so its pin and priority, are gone."""
        if self.ttl:
            self.ttl.pop(block_id, None)
        if self.until:
            self.until.pop(block_id, None)
        self.levels.clear(block_id)

    def tick(self) -> None:
        """One Step of the pool: retention priorities age, pins past their time end."""
        self.levels.tick()
        if not self._ends:
            return
        now, ends = self.clock(), self._ends
        while ends and ends[0][0] <= now:
            until, block_id = heapq.heappop(ends)
            if self.until.get(block_id) != until:
                continue  # a stale entry: re-pinned later, ended, or its content gone
            del self.until[block_id]
            if self.pinned.pop(block_id, None) is not None:  # (a block in use stays so)
                self.levels.push(block_id)
        if len(ends) > 4 * max(len(self.until), 64):  # mostly stale: rebuild
            self._ends = [(until, b) for b, until in self.until.items()]
            heapq.heapify(self._ends)

    # ---- passed to the retention levels ----------------------------------------------------

    def retain(self, block_id: int, priority: int) -> None:
        self.levels.retain(block_id, priority)

    def touch(self, block_id: int) -> None:
        if block_id not in self.pinned:
            self.levels.touch(block_id)

    def forget(self, block_id: int, key: bytes) -> None:
        self.ttl.pop(block_id, None)
        self.until.pop(block_id, None)
        self.levels.forget(block_id, key)

    def missed(self, key: bytes) -> None:
        self.levels.missed(key)

    @property
    def step(self) -> int:
        return self.levels.step

    @property
    def num_demoted(self) -> int:
        return self.levels.num_demoted

    def __len__(self) -> int:
        return len(self.levels) + len(self.pinned)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.pinned or block_id in self.levels
