"""Preemption by swapping (``--preemption-mode swap``), the PagedAttention paper's other
option: a preempted sequence's blocks go to the host tier (a SwapOut) and come back (a SwapIn)
instead of being computed again. :class:`Swapping` (held by :class:`~.scheduler.Scheduler`)
owns the swapped-out sequences and the host slots they hold.

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

import structlog

from services.blockmgr.api.types import NO_SLOT, OpStatus, RestoredSequence, StepResult
from services.common.blocks import NULL_BLOCK, blocks_to_grow, first_live_block
from services.executor.core.config import SchedulerConfig
from services.executor.core.plan import BadAnswer, SchedulePlan
from services.executor.core.sequence import SeqStatus, Sequence
from services.executor.core.table_mirror import pool_view

__all__ = ["Swapping", "check_swaps"]

log = structlog.get_logger(__name__)


def _sort_key(seq: Sequence) -> tuple[int, int, int]:
    return seq.sort_key


def _live_blocks(tables: list[list[int]]) -> int:
    """The blocks ``tables`` hold (their null entries hold none)."""
    return sum(1 for t in tables for b in t if b != NULL_BLOCK)


class Swapping:
    """The swapped-out sequences (``swapped``, in priority order, each SWAPPED) and the host
    slots they hold. The scheduler moves sequences out of and back into its own queues; a
    sequence enters ``swapped`` by :meth:`swap_out` and leaves it by :meth:`remove` or the
    lists :meth:`apply` and :meth:`unswap` return."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.swapped: list[Sequence] = []  # sorted by sort_key
        self.slots_used = 0  # host slots our swapped-out sequences hold (at most)
        self.num_swapped_out = 0

    def can_take(self, seq: Sequence) -> bool:
        """Whether running ``seq`` (not a fork still to send) can be swapped out: swapping is
        on, it holds blocks, it is no beam, and its blocks fit the free host slots."""
        cfg = self.config
        return bool(
            cfg.swap_slots
            and seq.tables[0]
            and not seq.params.use_beam_search
            and _live_blocks(seq.tables) <= cfg.swap_slots - self.slots_used
        )

    def swap_out(self, seq: Sequence, plan: SchedulePlan) -> None:
        """Swap ``seq`` out with this plan's Step, its tables as they are now (their released
        entries, a sliding group's, need no slot and stay released). The caller then takes
        it out of the running ones and drops its blocks from the mirror."""
        n = _live_blocks(seq.tables)
        plan.swap_outs.append((seq, seq.tables))
        plan.released.append(pool_view(seq))
        seq.num_swap_slots = n
        seq.num_draft_computed = 0  # (a draft model's KV does not go to the host tier)
        self.slots_used += n
        seq.status = SeqStatus.SWAPPED
        self.num_swapped_out += 1
        bisect.insort(self.swapped, seq, key=_sort_key)
        log.warning(
            "sequence_swapped_out",
            req_id=seq.req_id,
            seq_id=seq.seq_id,
            num_blocks=n,
            num_computed_tokens=seq.num_computed_tokens,
        )

    def plan_swap_ins(
        self, plan: SchedulePlan, free: int, running: list[Sequence]
    ) -> Sequence | None:
        """Swap sequences back in, in priority order, while they fit ``free`` blocks beside
        the headroom the ``running`` ones need (as an admission leaves it), once every running
        sequence is decoding. Returns a sequence that can never come back (its blocks do not
        fit the pool even alone, nothing else running): the caller frees it with ``plan``'s
        Step and recomputes it instead, never leaving it waiting forever."""
        cfg = self.config
        # Not while a running sequence still has prompt chunks to compute: their blocks come
        # first, and would preempt what came back at once (a swap in and out every step).
        chunk = {s.seq_id: k for s, k in (*plan.grows, *plan.granted)}
        if any(
            len(s.token_ids) - s.num_computed_tokens - chunk.get(s.seq_id, 0) > 1 for s in running
        ):
            return None
        adapters = {s.lora_id for s in running if s.lora_id} if cfg.max_loras else set()
        for seq in self.swapped:
            others = len(running) + len(plan.swap_ins)
            if others >= cfg.max_num_seqs:
                return None
            if seq.lora_id and seq.lora_id not in adapters:
                if len(adapters) >= cfg.max_loras:
                    return None  # its adapter waits for a slot (the running ones drain)
                adapters.add(seq.lora_id)
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
                if not (running or plan.swap_ins or plan.grows):
                    return seq  # nothing else would ever make room
                return None
            plan.swap_ins.append(seq)
            free -= need
        return None

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
        first = first_live_block(seq.num_pool_tokens, cfg.sliding_window, cfg.block_size)
        return max(0, first - released) * sum(slides)

    def apply(
        self, plan: SchedulePlan, result: StepResult
    ) -> list[tuple[Sequence, tuple[int, ...]]]:
        """Take the (checked, :func:`check_swaps`) swap results: slots of the swapped-out
        sequences; returns the swapped-in ones with their blocks (group-major), no longer
        swapped: the caller gives them their tables and runs them from the next step on."""
        out, back = plan.swap_answers(result)
        if out is not None:
            for (seq, _), slots in zip(plan.swap_outs, out.host_slots, strict=True):
                if seq.status is SeqStatus.SWAPPED:  # (not finished meanwhile)
                    seq.host_slots = slots
        if back is None:
            return []
        returned: list[tuple[Sequence, tuple[int, ...]]] = []
        for seq, status, ids in zip(plan.swap_ins, back.statuses, back.block_ids, strict=True):
            if status is not OpStatus.OK:
                continue  # no room after all: it stays out
            self.remove(seq)
            returned.append((seq, ids))
        return returned

    def unswap(self, plan: SchedulePlan) -> list[Sequence]:
        """The answer to ``plan`` was rejected: its swap-outs (those not finished since) are
        no longer swapped, returned for the caller to recompute."""
        back: list[Sequence] = []
        for seq, _ in plan.swap_outs:
            if seq.status is not SeqStatus.SWAPPED or seq.host_slots:
                continue
            self.remove(seq)
            back.append(seq)
        return back

    def remove(self, seq: Sequence) -> None:
        """``seq`` is no longer swapped out (back in, finished, or recomputed): its slots are
        not counted any more (the pool frees them with the Step that says so)."""
        self.swapped.remove(seq)
        self.slots_used -= seq.num_swap_slots
        seq.host_slots, seq.num_swap_slots = (), 0

    def views(self) -> list[RestoredSequence]:
        """The pool's view of the swapped-out sequences whose swap-out was answered."""
        return [pool_view(s) for s in self.swapped if s.host_slots]


def check_swaps(
    plan: SchedulePlan, result: StepResult, *, swap_slots: int, num_blocks: int
) -> None:
    """Raise :class:`BadAnswer` unless every swap-out of ``plan`` went through with one slot
    per block, in range (``swap_slots``), and every swap-in that did got a table of its
    length, of blocks in range (``num_blocks``: the pool's size, the null block included)
    that no grow of the Step was given."""
    out, back = plan.swap_answers(result)
    if out is not None:
        if len(out.statuses) != len(plan.swap_outs) or len(out.host_slots) != len(plan.swap_outs):
            raise BadAnswer("a swap-out answer of the wrong length", plan.swap_ids())
        for (seq, tables), status, got in zip(
            plan.swap_outs, out.statuses, out.host_slots, strict=True
        ):
            entries = [b for t in tables for b in t]
            if status is not OpStatus.OK or len(got) != len(entries):
                raise BadAnswer(f"swap-out {status.name}, {len(got)} slots", {seq.seq_id})
            if not all(
                s == NO_SLOT if b == NULL_BLOCK else 0 <= s < swap_slots
                for s, b in zip(got, entries, strict=True)
            ):
                raise BadAnswer("a swap-out slot out of range", {seq.seq_id})
    if back is not None:
        if len(back.statuses) != len(plan.swap_ins) or len(back.block_ids) != len(plan.swap_ins):
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
                b == NULL_BLOCK if slot == NO_SLOT else 0 < b < num_blocks
                for b, slot in zip(ids, seq.host_slots, strict=True)
            ):
                raise BadAnswer("a swapped-in block out of range", {seq.seq_id})
            if not granted.isdisjoint(ids):  # new to a grow of this Step, and to this table
                raise BadAnswer("a swapped-in block also granted to a grow", {seq.seq_id})
