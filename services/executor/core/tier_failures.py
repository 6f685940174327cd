"""Moves that failed (a disk tier the runner could not read or write): reported to the block
manager in the next Step (``UncacheOp``, its first operation), so that it forgets what those
blocks and slots were cached as, and the sequences whose tables list a block that was not
filled are computed again. None of them has read it: a sequence whose blocks a Step fills
runs only after the fills (in line, before the forward; beside it, held back a step), and
the engine takes the failures before every forward. :class:`TierFailures` is held by
:class:`~.scheduler.Scheduler`, which preempts those sequences.
"""

from __future__ import annotations

from services.blockmgr.api.types import Uncache
from services.executor.core.sequence import Sequence

__all__ = ["TierFailures"]


class TierFailures:
    """The failed moves not reported yet, as one pending :class:`Uncache`."""

    def __init__(self) -> None:
        self._uncache: Uncache | None = None

    @property
    def pending(self) -> bool:
        """Some failed moves are still to report (a Step must go out)."""
        return self._uncache is not None

    def add(self, device_blocks: tuple[int, ...], disk_slots: tuple[int, ...]) -> None:
        """Report these failed moves with the next Step (with those pending already)."""
        pending = self._uncache or Uncache()
        self._uncache = Uncache(
            pending.device_blocks + device_blocks,
            pending.host_slots,
            pending.disk_slots + disk_slots,
        )

    def take(self) -> Uncache | None:
        """The failed moves to report in the Step being planned; none is pending after."""
        uncache, self._uncache = self._uncache, None
        return uncache


def readers(running: list[Sequence], device_blocks: tuple[int, ...]) -> list[Sequence]:
    """The ``running`` sequences whose tables list one of ``device_blocks`` (in order)."""
    failed = set(device_blocks)
    return [s for s in running if any(not failed.isdisjoint(t) for t in s.tables)]
