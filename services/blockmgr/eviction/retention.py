"""Retention priorities: a request's hint that its prefix is worth keeping (SGLang's priority
eviction, Dynamo's retention hints), layered over the pool's eviction policy.

An admission may carry ``retention_priority`` 0 .. :data:`MAX_RETENTION_PRIORITY` (0: none).
The blocks the sequence hits or commits take the highest priority any sequence gave them.
Cached free blocks are evicted lowest priority first, each level in the pool's policy order
(one policy per level). It is a hint, not a pin, and bounded: a block keeps its priority for
``retention_steps`` Steps of its pool after it was freed, then is demoted to 0 (entering that
level as if freed then). So a retained system prompt outlives a burst of one-off prompts, but
a pool full of retained blocks still serves new work, and nothing is retained for good.
"""

from __future__ import annotations

from collections import deque

from services.blockmgr.api.types import EvictionPolicyName
from services.blockmgr.eviction.adaptive import KeyOf
from services.blockmgr.eviction.policies import EvictionPolicy, make_policy
from services.common.limits import MAX_KV_RETENTION_PRIORITY

__all__ = ["DEFAULT_RETENTION_STEPS", "MAX_RETENTION_PRIORITY", "RetentionLevels"]

MAX_RETENTION_PRIORITY = MAX_KV_RETENTION_PRIORITY
DEFAULT_RETENTION_STEPS = 4096


class RetentionLevels:
    """An :class:`~.eviction.EvictionPolicy` over one policy per retention priority."""

    def __init__(
        self,
        policy: EvictionPolicyName | str,
        capacity: int,
        key_of: KeyOf,
        retention_steps: int = DEFAULT_RETENTION_STEPS,
    ) -> None:
        policy = EvictionPolicyName.parse(policy)
        self.name = policy.value
        self.levels: list[EvictionPolicy] = [
            make_policy(policy, capacity, key_of) for _ in range(MAX_RETENTION_PRIORITY + 1)
        ]
        self.retention_steps = retention_steps
        self.step = 0  # the pool's Steps so far
        self.priority: dict[int, int] = {}  # block -> its priority, when > 0
        self._freed_at: dict[int, int] = {}  # retained free block -> the step it was freed
        self._expiry: deque[tuple[int, int]] = deque()  # (step freed, block), oldest first
        self.num_demoted = 0
        # Until a priority is first given, level 0 is the only one in use: pop, forget and
        # missed go straight to it (the hot path of a pool that uses no priorities).
        self._leveled = False

    def retain(self, block_id: int, priority: int) -> None:
        """Raise an in-use block's priority to ``priority``."""
        if priority > self.priority.get(block_id, 0):
            self.priority[block_id] = priority
            self._leveled = True

    def clear(self, block_id: int) -> None:
        """A block handed out again: its content, and so its priority, is gone."""
        self.priority.pop(block_id, None)

    def push(self, block_id: int) -> None:
        level = self.priority.get(block_id, 0)
        self.levels[level].push(block_id)
        if level:
            self._freed_at[block_id] = self.step
            self._expiry.append((self.step, block_id))

    def remove(self, block_id: int) -> None:
        self.levels[self.priority.get(block_id, 0)].remove(block_id)
        self._freed_at.pop(block_id, None)

    def discard(self, block_id: int) -> None:
        self.levels[self.priority.get(block_id, 0)].discard(block_id)
        self._freed_at.pop(block_id, None)

    def tick(self) -> None:
        """One Step of the pool went by: priorities past their bound expire now."""
        self.step += 1
        self._demote_expired()

    def pop(self) -> int:
        if not self._leveled:
            return self.levels[0].pop()
        for level in self.levels:
            if len(level):
                block_id = level.pop()
                self._freed_at.pop(block_id, None)
                return block_id
        raise IndexError("pop from an empty eviction order")

    def touch(self, block_id: int) -> None:
        self.levels[self.priority.get(block_id, 0)].touch(block_id)

    def forget(self, block_id: int, key: bytes) -> None:
        # Every level: the block may have been hit at one priority and freed at another; only
        # the level that popped it keeps a ghost of ``key``.
        if not self._leveled:
            self.levels[0].forget(block_id, key)
            return
        self.priority.pop(block_id, None)
        for level in self.levels:
            level.forget(block_id, key)

    def missed(self, key: bytes) -> None:
        if not self._leveled:
            self.levels[0].missed(key)
            return
        for level in self.levels:
            level.missed(key)

    def __len__(self) -> int:
        return sum(len(level) for level in self.levels)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.levels[self.priority.get(block_id, 0)]

    def _demote_expired(self) -> None:
        expiry, horizon = self._expiry, self.step - self.retention_steps
        while expiry and expiry[0][0] <= horizon:
            freed, block_id = expiry.popleft()
            if self._freed_at.get(block_id) != freed:
                continue  # taken back (a hit) or evicted since: a stale entry
            del self._freed_at[block_id]
            level = self.priority.pop(block_id)
            self.levels[level].discard(block_id)
            self.levels[0].push(block_id)
            self.num_demoted += 1
