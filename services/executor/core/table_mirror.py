"""The scheduler's mirror of its sequences' block tables and of the refcounts of the blocks
they hold (:class:`TableMirror`, held by :class:`~.scheduler.Scheduler`): what a grow needs
(new blocks in every KV-cache group, copy-on-write), the release of blocks out of a sliding
window, as the block manager applies it at the same grow, and the block manager's answers
taken into the tables. The scheduler is the only client of its pool, so the mirror is exact.

In a sliding-window pool (``SchedulerConfig.sliding_window``) every grow also releases the
blocks that fell out of the window of the sequence's queries still to come (the block manager
applies the same rule, :func:`services.common.blocks.first_live_block`, at the same grow
entry); their table entries become the null block. A hybrid pool (several KV-cache groups,
``SchedulerConfig.kv_group_slides``) gives each sequence one table per group, of equal length:
every grow adds the same number of blocks to each, and only the sliding groups release.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable

import structlog

from services.blockmgr.api.types import AdmitResult, GrowResult, OpStatus, RestoredSequence
from services.common.blocks import NULL_BLOCK, blocks_to_grow, first_live_block, needs_cow
from services.executor.core.config import SchedulerConfig
from services.executor.core.plan import SchedulePlan, check_answer, extend_tables, split_tables
from services.executor.core.sequence import SeqStatus, Sequence

__all__ = ["TableMirror", "pool_view"]

log = structlog.get_logger(__name__)


def pool_view(seq: Sequence) -> RestoredSequence:
    """What the block manager holds for ``seq``: its slots, table and committed hashes
    (a swapped-out sequence: its host slots instead of a table). Its tokens are the pool's
    count: accepted drafts not reported yet are not in it, its lookahead slots are beyond it."""
    if seq.status is SeqStatus.SWAPPED:
        return RestoredSequence(
            seq.seq_id,
            seq.num_pool_tokens,
            (),
            tuple(seq.block_hashes[: seq.num_committed_blocks]),
            seq.host_slots,
            seq.num_surplus_slots,
        )
    return RestoredSequence(
        seq.seq_id,
        seq.num_pool_tokens + seq.num_ahead_slots,
        tuple(seq.tables[0]) if len(seq.tables) == 1 else tuple(itertools.chain(*seq.tables)),
        tuple(seq.block_hashes[: seq.num_committed_blocks]),
        num_lookahead=seq.num_surplus_slots,
    )


class TableMirror:
    """The refcounts of the blocks the scheduler's sequences hold (``refs``), and the one
    place that changes a sequence's ``tables`` and ``first_live_block``.

    ``refs`` maps a block id to how many of our tables hold it (null entries hold none). Hot
    paths read it directly; it changes only through these methods. A sequence whose Free is
    pending (:meth:`detach`) no longer has tables, but its blocks stay counted until that
    Free is planned (:meth:`release`)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.refs: Counter[int] = Counter()
        self._block_size = config.block_size
        self._window = config.sliding_window
        self._slides = config.group_slides
        self._num_groups = len(self._slides)

    # ---- what a grow needs, and the check of an answer (nothing changes) ---------------

    def cow_groups(self, seq: Sequence, k: int) -> tuple[int, ...]:
        """The groups whose last block ``seq`` must copy before writing ``k`` tokens."""
        if not seq.tables[0]:
            return ()
        bs, computed, refs = self._block_size, seq.num_computed_tokens, self.refs
        return tuple(g for g, t in enumerate(seq.tables) if needs_cow(computed, k, bs, refs[t[-1]]))

    def blocks_needed(self, seq: Sequence, k: int) -> int:
        """The new blocks ``seq`` needs to write ``k`` more tokens, copies included."""
        need = blocks_to_grow(seq.num_computed_tokens, k, len(seq.tables[0]), self._block_size)
        return need * len(seq.tables) + len(self.cow_groups(seq, k))

    def first_live_after(self, seq: Sequence, held: int) -> int:
        """``seq``'s first live block once a grow from ``held`` slots (its next query is at
        that position) has released what left that query's window."""
        first = first_live_block(held, self._window, self._block_size)
        return max(first, seq.first_live_block)

    def releasable(self, seq: Sequence, first: int) -> int:
        """How many blocks :meth:`release_to` ``first`` would free (nothing changes)."""
        start, refs = seq.first_live_block, self.refs
        if first <= start:
            return 0
        return sum(
            1
            for table, slid in zip(seq.tables, self._slides, strict=True)
            if slid
            for b in table[start:first]
            if b != NULL_BLOCK and refs[b] == 1
        )

    def check_answer(
        self,
        plan: SchedulePlan,
        grow: GrowResult | None,
        admitted: list[AdmitResult],
        *,
        num_blocks: int,
    ) -> None:
        """Raise :class:`~.plan.BadAnswer` unless the answer to ``plan``'s grows and
        admissions fits the mirror (:func:`~.plan.check_answer`; ``num_blocks``: the pool's
        size, the null block included)."""
        check_answer(
            plan,
            grow,
            admitted,
            block_size=self._block_size,
            num_blocks=num_blocks,
            refs=self.refs,
            sliding_window=self._window,
            group_slides=self._slides,
        )

    # ---- releases ---------------------------------------------------------------------------

    def slide(self, seq: Sequence, held: int) -> int:
        """Mirror a sliding-window pool's release at ``seq``'s grow from ``held`` slots: the
        blocks out of the window of its next query become the null block, and our references
        to them go. Returns how many blocks that frees (0 for full attention). A table is
        slid only once the step that reads it has been built (the batch copies it)."""
        if not self._window:
            return 0
        return self.release_to(seq, self.first_live_after(seq, held))

    def release_to(self, seq: Sequence, first: int) -> int:
        """Null ``seq``'s table entries before ``first`` and drop our references to them;
        returns how many blocks that frees."""
        start = seq.first_live_block
        if first <= start:
            return 0
        freed = 0
        for g, slides in enumerate(self._slides):
            if slides:
                table = list(seq.tables[g])  # a new list: runners mirror tables that only grow
                freed += self.release(table[start:first])
                table[start:first] = [NULL_BLOCK] * (first - start)
                seq.tables[g] = table
        seq.first_live_block = first
        return freed

    def release(self, table: Iterable[int]) -> int:
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

    def drop(self, seq: Sequence) -> int:
        """Release all of ``seq``'s blocks now and empty its tables; returns how many blocks
        that frees."""
        freed = sum(self.release(t) for t in seq.tables)
        seq.tables = [[] for _ in seq.tables]
        return freed

    def detach(self, seq: Sequence) -> None:
        """Empty ``seq``'s tables, whose Free goes out with a later Step: its blocks stay
        counted until that Step is planned, which releases the view sent with the Free."""
        seq.tables = [[] for _ in seq.tables]

    # ---- blocks taken ---------------------------------------------------------------------

    def share(self, parent: Sequence, child: Sequence) -> None:
        """``child`` holds all of ``parent``'s blocks too (a fork)."""
        child.tables = [list(t) for t in parent.tables]
        child.first_live_block = parent.first_live_block
        for table in child.tables:
            self._hold(table)

    def admit(self, seq: Sequence, block_ids: tuple[int, ...], num_cached_tokens: int) -> None:
        """``seq`` was admitted with ``block_ids`` (group-major), its first
        ``num_cached_tokens`` cached."""
        seq.tables = split_tables(block_ids, self._num_groups)
        # Leading null entries (sliding groups): released, out of its first query's window.
        seq.first_live_block = first_live_block(num_cached_tokens, self._window, self._block_size)
        self._hold(block_ids)

    def swap_in(self, seq: Sequence, block_ids: tuple[int, ...]) -> None:
        """``seq`` was swapped back in, into ``block_ids`` (group-major)."""
        seq.tables = split_tables(block_ids, self._num_groups)
        # (every sliding group released the same leading entries)
        slides = self._slides
        sliding = next((t for t, slid in zip(seq.tables, slides, strict=True) if slid), [])
        seq.first_live_block = next((i for i, b in enumerate(sliding) if b), len(sliding))
        self._hold(block_ids)

    def give_up_shares(self, seq: Sequence, groups: Iterable[int]) -> None:
        """``seq`` will write into its last block of ``groups``, which it shares: it drops its
        share as the pool will (the pool copies the block for it)."""
        for g in groups:
            self.refs[seq.tables[g][-1]] -= 1

    def take_back_shares(self, seq: Sequence, groups: Iterable[int]) -> None:
        """Undo :meth:`give_up_shares`: the copy-on-write grow did not happen."""
        for g in groups:
            self.refs[seq.tables[g][-1]] += 1

    def apply_grow(
        self, plan: SchedulePlan, grow: GrowResult
    ) -> tuple[set[int], list[tuple[int, int]]]:
        """Take the (checked) answer to ``plan``'s grows into the tables: new blocks and
        copy-on-write copies. Returns the ids of the sequences whose grow the pool refused
        (their tables unchanged, their shares taken back; the scheduler requeues them) and
        the (src, dst) block copies to make."""
        failed: set[int] = set()
        seqs = [s for s, _ in plan.grows]
        refs, ok = self.refs, OpStatus.OK
        if grow.statuses.count(ok) == len(seqs):  # the common case: every grow went through
            for seq, new_ids in zip(seqs, grow.new_block_ids, strict=True):
                if new_ids:
                    extend_tables(seq.tables, new_ids)
                    for b in new_ids:
                        refs[b] += 1
        else:
            failed = self._apply_grow_statuses(plan, seqs, grow)
        copies: list[tuple[int, int]] = []
        for copy in grow.copies:
            seq = seqs[copy.entry]
            # A new list, never an edit in place: runners mirror tables that only grow
            # (see forward_batch.SeqChunk).
            table = list(seq.tables[copy.group])
            table[copy.block_index] = copy.dst
            seq.tables[copy.group] = table
            refs[copy.dst] += 1
            copies.append((copy.src, copy.dst))
        return failed, copies

    def _apply_grow_statuses(
        self, plan: SchedulePlan, seqs: list[Sequence], grow: GrowResult
    ) -> set[int]:
        failed: set[int] = set()
        for seq, status, new_ids in zip(seqs, grow.statuses, grow.new_block_ids, strict=True):
            if status is not OpStatus.OK:
                # Our counters said it fits; the pool disagrees: recompute it later.
                log.warning("grow_refused", seq_id=seq.seq_id, status=status.name)
                failed.add(seq.seq_id)
                self.take_back_shares(seq, plan.cow_ids.get(seq.seq_id, ()))
                continue
            extend_tables(seq.tables, new_ids)
            self._hold(new_ids)
        return failed

    def _hold(self, block_ids: Iterable[int]) -> None:
        """One more reference to each block of ``block_ids`` (null entries hold none)."""
        refs = self.refs
        for b in block_ids:
            if b != NULL_BLOCK:
                refs[b] += 1
