"""The scheduler's mirror of its sequences' block tables and of the refcounts of the blocks
they hold: what a grow needs (new blocks in every KV-cache group, copy-on-write), and the
release of blocks out of a sliding window, as the block manager applies it at the same grow.
A part of :class:`~.scheduler.Scheduler`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.common.blocks import NULL_BLOCK, blocks_to_grow, first_live_block, needs_cow
from services.executor.core.sequence import Sequence

if TYPE_CHECKING:
    from collections import Counter

    from services.executor.core.config import SchedulerConfig

__all__ = ["TableMirror"]


class TableMirror:
    if TYPE_CHECKING:  # provided by Scheduler
        config: SchedulerConfig
        refs: Counter[int]

    def _cow_groups(self, seq: Sequence, k: int) -> tuple[int, ...]:
        """The groups whose last block ``seq`` must copy before writing ``k`` tokens."""
        if not seq.tables[0]:
            return ()
        bs, computed, refs = self.config.block_size, seq.num_computed_tokens, self.refs
        return tuple(g for g, t in enumerate(seq.tables) if needs_cow(computed, k, bs, refs[t[-1]]))

    def _blocks_needed(self, seq: Sequence, k: int) -> int:
        bs = self.config.block_size
        need = blocks_to_grow(seq.num_computed_tokens, k, len(seq.tables[0]), bs)
        return need * len(seq.tables) + len(self._cow_groups(seq, k))

    def _first_live_after(self, seq: Sequence, held: int) -> int:
        """``seq``'s first live block once a grow from ``held`` slots (its next query is at
        that position) has released what left that query's window."""
        first = first_live_block(held, self.config.sliding_window, self.config.block_size)
        return max(first, seq.first_live_block)

    def _slide(self, seq: Sequence, held: int) -> int:
        """Mirror a sliding-window pool's release at ``seq``'s grow from ``held`` slots: the
        blocks out of the window of its next query become the null block, and our references
        to them go. Returns how many blocks that frees (0 for full attention). A table is
        slid only once the step that reads it has been built (the batch copies it)."""
        if not self.config.sliding_window:
            return 0
        return self._release_to(seq, self._first_live_after(seq, held))

    def _releasable(self, seq: Sequence, first: int) -> int:
        """How many blocks :meth:`_release_to` ``first`` would free (nothing changes)."""
        start, refs = seq.first_live_block, self.refs
        if first <= start:
            return 0
        slides = self.config.group_slides
        return sum(
            1
            for table, slid in zip(seq.tables, slides, strict=True)
            if slid
            for b in table[start:first]
            if b != NULL_BLOCK and refs[b] == 1
        )

    def _release_to(self, seq: Sequence, first: int) -> int:
        """Null ``seq``'s table entries before ``first`` and drop our references to them;
        returns how many blocks that frees."""
        start = seq.first_live_block
        if first <= start:
            return 0
        freed = 0
        for g, slides in enumerate(self.config.group_slides):
            if slides:
                table = list(seq.tables[g])  # a new list: runners mirror tables that only grow
                freed += self._release(table[start:first])
                table[start:first] = [NULL_BLOCK] * (first - start)
                seq.tables[g] = table
        seq.first_live_block = first
        return freed

    def _release(self, table: Iterable[int]) -> int:
        """Drop one reference to each block of ``table`` (null entries hold none); return
        how many became free."""
        freed = 0
        refs = self.refs
        for b in table:
            if b == NULL_BLOCK:
                continue
            refs[b] -= 1
            if refs[b] == 0:
                del refs[b]
                freed += 1
        return freed
