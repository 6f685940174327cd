"""Preemption by swapping (``--preemption-mode swap``), the PagedAttention paper's other
option: a preempted sequence's blocks go to the host tier (a SwapOut) and come back (a SwapIn)
instead of being computed again. A part of :class:`~.scheduler.Scheduler`.

A running sequence the scheduler must preempt while planning is swapped out when its table
fits in the host slots no other swapped-out sequence holds (counted here, so the block manager
never refuses), it is not a beam of a search nor a fork not yet sent; otherwise it is
recomputed. A swapped-out sequence keeps its computed tokens and its committed blocks. Swapped
sequences come back first, in priority order, as soon as their blocks fit beside the running
ones' headroom; no new admission is planned while one is still out. A swapped-in sequence
runs from the next step on.

Everything else holds as for recomputation: a finished or aborted swapped-out sequence is
freed (its slots), a resync restores swapped-out sequences from their slots (the runner still
holds their content), and an answer that contradicts the plan turns the plan's swap-outs into
recomputations (the pool is then rebuilt from our state, where they hold nothing).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import structlog

from services.blockmgr.api.types import NO_SLOT, OpStatus, RestoredSequence, StepResult
from services.common.blocks import NULL_BLOCK, blocks_to_grow, first_live_block
from services.executor.core.plan import BadAnswer, SchedulePlan, split_tables
from services.executor.core.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from collections import Counter
    from collections.abc import Iterable

    from services.blockmgr.api.types import Fork
    from services.executor.core.config import SchedulerConfig

__all__ = ["Swapping"]

log = structlog.get_logger(__name__)


def _sort_key(seq: Sequence) -> tuple[int, int, int]:
    return seq.sort_key


def _live_blocks(tables: list[list[int]]) -> int:
    """The blocks ``tables`` hold (their null entries hold none)."""
    return sum(1 for t in tables for b in t if b != NULL_BLOCK)


class Swapping:
    if TYPE_CHECKING:  # provided by Scheduler
        config: SchedulerConfig
        running: list[Sequence]
        waiting: list[Sequence]
        refs: Counter[int]
        num_preemptions: int
        _forks: dict[int, Fork]
        _to_free: list[RestoredSequence]

        def pool_view(self, seq: Sequence) -> RestoredSequence: ...
        def _release(self, table: Iterable[int]) -> int: ...

    swapped: list[Sequence]  # sorted by sort_key
    swap_slots_used: int  # host slots our swapped-out sequences hold (at most)
    num_swapped_out: int
    num_usable_blocks: int

    def _can_swap(self, seq: Sequence) -> bool:
        cfg = self.config
        return bool(
            cfg.swap_slots
            and seq.tables[0]
            and seq.seq_id not in self._forks
            and not seq.params.use_beam_search
            and _live_blocks(seq.tables) <= cfg.swap_slots - self.swap_slots_used
        )

    def _swap_out(self, seq: Sequence, plan: SchedulePlan) -> int:
        """Swap ``seq`` out with this plan's Step; returns how many blocks that frees. Its
        tables' released entries (a sliding group's) need no slot and stay released."""
        n = _live_blocks(seq.tables)
        plan.swap_outs.append((seq, seq.tables))
        plan.released.append(self.pool_view(seq))
        freed = sum(self._release(t) for t in seq.tables)
        seq.tables = [[] for _ in seq.tables]
        seq.num_swap_slots = n
        self.swap_slots_used += n
        self.running.remove(seq)
        seq.status = SeqStatus.SWAPPED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.num_swapped_out += 1
        bisect.insort(self.swapped, seq, key=_sort_key)
        log.warning(
            "sequence_swapped_out",
            req_id=seq.req_id,
            seq_id=seq.seq_id,
            num_blocks=n,
            num_computed_tokens=seq.num_computed_tokens,
        )
        return freed

    def _plan_swap_ins(self, plan: SchedulePlan, free: int) -> None:
        """Swap sequences back in, in priority order, while they fit ``free`` blocks beside
        the headroom the running ones need (as an admission leaves it), once every running
        sequence is decoding."""
        cfg = self.config
        # Not while a running sequence still has prompt chunks to compute: their blocks come
        # first, and would preempt what came back at once (a swap in and out every step).
        chunk = {s.seq_id: k for s, k in (*plan.grows, *plan.granted)}
        if any(
            len(s.token_ids) - s.num_computed_tokens - chunk.get(s.seq_id, 0) > 1
            for s in self.running
        ):
            return
        for seq in self.swapped:
            others = len(self.running) + len(plan.swap_ins)
            if others >= cfg.max_num_seqs:
                return
            # Its blocks, and those of its next prompt chunk if it was prefilling (else that
            # chunk would preempt it again at once), in every group, less what that chunk's
            # grow releases out of a sliding window.
            held = sum(1 for slot in seq.host_slots if slot != NO_SLOT)
            groups = cfg.num_kv_groups
            length = len(seq.host_slots) // groups
            left = len(seq.token_ids) - seq.num_computed_tokens
            k = min(left, cfg.max_num_batched_tokens) if left > 1 else 0
            grow = blocks_to_grow(seq.num_computed_tokens, k, length, cfg.block_size)
            need = held + max(0, grow * groups - self._pending_release(seq, length))
            reserve = cfg.watermark_blocks + others if others else 0
            if need + reserve > free:
                if not (self.running or plan.swap_ins or plan.grows):
                    self._recompute_swapped(seq, plan)  # nothing else would ever make room
                return
            plan.swap_ins.append(seq)
            free -= need

    def _pending_release(self, seq: Sequence, length: int) -> int:
        """The blocks of swapped-out ``seq`` (tables of ``length``) that its next grow
        releases out of the window (every sliding group the same)."""
        cfg = self.config
        slides = cfg.group_slides
        if not any(slides):
            return 0
        g = slides.index(True)
        run = seq.host_slots[g * length : (g + 1) * length]
        released = next((i for i, slot in enumerate(run) if slot != NO_SLOT), length)
        first = first_live_block(seq.num_computed_tokens, cfg.sliding_window, cfg.block_size)
        return max(0, first - released) * sum(slides)

    def _recompute_swapped(self, seq: Sequence, plan: SchedulePlan) -> None:
        """``seq`` cannot come back (its blocks do not fit the pool even alone): it is freed
        with ``plan``'s Step and recomputed instead, never left waiting forever."""
        log.warning("swapped_sequence_recomputed", seq_id=seq.seq_id, req_id=seq.req_id)
        plan.free_seq_ids.append(seq.seq_id)
        plan.released.append(self.pool_view(seq))
        self.swapped.remove(seq)
        self.swap_slots_used -= seq.num_swap_slots
        seq.host_slots, seq.num_swap_slots = (), 0
        seq.num_computed_tokens = seq.num_committed_blocks = seq.first_live_block = 0
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=_sort_key)

    def _check_swaps(self, plan: SchedulePlan, result: StepResult) -> None:
        """Raise :class:`BadAnswer` unless every swap-out went through with one slot per
        block, in range, and every swap-in that did got a table of its length, of blocks in
        range that no grow of the Step was given."""
        out, back = plan.swap_answers(result)
        slots = self.config.swap_slots
        if out is not None:
            if len(out.statuses) != len(plan.swap_outs) or len(out.host_slots) != len(
                plan.swap_outs
            ):
                raise BadAnswer("a swap-out answer of the wrong length", plan.swap_ids())
            for (seq, tables), status, got in zip(
                plan.swap_outs, out.statuses, out.host_slots, strict=True
            ):
                entries = [b for t in tables for b in t]
                if status is not OpStatus.OK or len(got) != len(entries):
                    raise BadAnswer(f"swap-out {status.name}, {len(got)} slots", {seq.seq_id})
                if not all(
                    s == NO_SLOT if b == NULL_BLOCK else 0 <= s < slots
                    for s, b in zip(got, entries, strict=True)
                ):
                    raise BadAnswer("a swap-out slot out of range", {seq.seq_id})
        if back is not None:
            if len(back.statuses) != len(plan.swap_ins) or len(back.block_ids) != len(
                plan.swap_ins
            ):
                raise BadAnswer("a swap-in answer of the wrong length", plan.swap_ids())
            grow, _ = plan.answers(result)
            granted = (
                {b for ids in grow.new_block_ids for b in ids} | {c.dst for c in grow.copies}
                if grow is not None
                else set()
            )
            for seq, status, ids in zip(plan.swap_ins, back.statuses, back.block_ids, strict=True):
                if status is not OpStatus.OK:
                    continue
                live = [b for b, slot in zip(ids, seq.host_slots, strict=False) if slot != NO_SLOT]
                if len(ids) != len(seq.host_slots) or len(set(live)) != len(live):
                    raise BadAnswer("a swapped-in table of the wrong length", {seq.seq_id})
                if not all(
                    b == NULL_BLOCK if slot == NO_SLOT else 0 < b <= self.num_usable_blocks
                    for b, slot in zip(ids, seq.host_slots, strict=True)
                ):
                    raise BadAnswer("a swapped-in block out of range", {seq.seq_id})
                if not granted.isdisjoint(ids):  # new to a grow of this Step, and to this table
                    raise BadAnswer("a swapped-in block also granted to a grow", {seq.seq_id})

    def _apply_swaps(self, plan: SchedulePlan, result: StepResult) -> None:
        """Take the (checked) swap results: slots of the swapped-out sequences, tables of the
        swapped-in ones, which run from the next step on."""
        out, back = plan.swap_answers(result)
        if out is not None:
            for (seq, _), slots in zip(plan.swap_outs, out.host_slots, strict=True):
                if seq.status is SeqStatus.SWAPPED:  # (not finished meanwhile)
                    seq.host_slots = slots
        if back is None:
            return
        for seq, status, ids in zip(plan.swap_ins, back.statuses, back.block_ids, strict=True):
            if status is not OpStatus.OK:
                continue  # no room after all: it stays out
            self.swapped.remove(seq)
            self.swap_slots_used -= seq.num_swap_slots
            seq.host_slots, seq.num_swap_slots = (), 0
            seq.tables = split_tables(ids, self.config.num_kv_groups)
            # (every sliding group released the same leading entries)
            slides = self.config.group_slides
            sliding = next((t for t, slid in zip(seq.tables, slides, strict=True) if slid), [])
            seq.first_live_block = next((i for i, b in enumerate(sliding) if b), len(sliding))
            for b in ids:
                if b != NULL_BLOCK:
                    self.refs[b] += 1
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=_sort_key)

    def _unswap(self, plan: SchedulePlan) -> None:
        """The answer to ``plan`` was rejected: its swap-outs become recomputations."""
        for seq, _ in plan.swap_outs:
            if seq.status is not SeqStatus.SWAPPED or seq.host_slots:
                continue
            self.swapped.remove(seq)
            self.swap_slots_used -= seq.num_swap_slots
            seq.num_swap_slots = 0
            seq.num_computed_tokens = 0
            seq.num_committed_blocks = 0
            seq.first_live_block = 0
            seq.status = SeqStatus.WAITING
            bisect.insort(self.waiting, seq, key=_sort_key)

    def _free_swapped(self, seq: Sequence) -> None:
        """A swapped-out sequence finished (aborted): its slots are freed with the next Step."""
        self.swapped.remove(seq)
        self.swap_slots_used -= seq.num_swap_slots
        seq.num_swap_slots = 0
        self._to_free.append(self.pool_view(seq))

    def swapped_views(self) -> list[RestoredSequence]:
        """The pool's view of the swapped-out sequences whose swap-out was answered."""
        return [self.pool_view(s) for s in self.swapped if s.host_slots]
