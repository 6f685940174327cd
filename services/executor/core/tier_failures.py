"""Moves that failed (a disk tier the runner could not read or write): reported to the block
manager in the next Step (``UncacheOp``, its first operation), so that it forgets what those
blocks and slots were cached as, and the sequences whose tables list a block that was not
filled are computed again. None of them has read it: a sequence whose blocks a Step fills
runs only after the fills (in line, before the forward; beside it, held back a step), and
the engine takes the failures before every forward. A part of :class:`~.scheduler.Scheduler`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import structlog

from services.blockmgr.api.types import Uncache

if TYPE_CHECKING:
    from services.executor.core.sequence import Sequence

__all__ = ["TierFailures"]

log = structlog.get_logger(__name__)


class TierFailures:
    if TYPE_CHECKING:  # provided by Scheduler
        running: list[Sequence]
        _uncache: Uncache | None

        def preempt(self, seq: Sequence) -> None: ...

    def moves_failed(
        self, device_blocks: Iterable[int], disk_slots: Iterable[int]
    ) -> list[Sequence]:
        """Report these failed moves with the next Step, and preempt (to recompute) the
        running sequences whose tables list one of ``device_blocks``; returns them."""
        blocks, slots = tuple(device_blocks), tuple(disk_slots)
        pending = self._uncache or Uncache()
        self._uncache = Uncache(
            pending.device_blocks + blocks, pending.host_slots, pending.disk_slots + slots
        )
        failed = set(blocks)
        victims = [s for s in self.running if any(not failed.isdisjoint(t) for t in s.tables)]
        for seq in victims:
            self.preempt(seq)
        log.warning(
            "kv_tier_moves_failed",
            device_blocks=len(blocks),
            disk_slots=len(slots),
            recomputed=[s.seq_id for s in victims],
        )
        return victims

    def _take_uncache(self) -> Uncache | None:
        uncache, self._uncache = self._uncache, None
        return uncache
