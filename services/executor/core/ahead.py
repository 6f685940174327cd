"""Async scheduling: the next step planned before this step's forward, so that its
block-manager round trip overlaps the forward (``--async-scheduling``). A part of
:class:`~.scheduler.Scheduler`, kept apart because only the async path uses it."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from services.blockmgr.api.types import AdmitResult, Fork, GrowResult, OpStatus, StepResult
from services.common.blocks import blocks_to_grow, needs_cow
from services.executor.core.plan import ScheduledBatch, ScheduledChunk, SchedulePlan, step_moves
from services.executor.core.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from collections import Counter

    from services.executor.core.config import SchedulerConfig

__all__ = ["AheadScheduling"]


class AheadScheduling:
    """:meth:`plan_ahead` and :meth:`apply_ahead`, over the scheduler's state and helpers."""

    if TYPE_CHECKING:  # provided by Scheduler
        config: SchedulerConfig
        waiting: list[Sequence]
        running: list[Sequence]
        swapped: list[Sequence]
        granted: list[tuple[Sequence, int]]
        refs: Counter[int]
        num_free_blocks: int
        _forks: dict[int, Fork]

        def _open_plan(self) -> tuple[SchedulePlan, int]: ...
        def _slide(self, seq: Sequence, held: int) -> int: ...
        def _first_live_after(self, seq: Sequence, held: int) -> int: ...
        def _release_to(self, seq: Sequence, first: int) -> int: ...
        def _plan_admissions(self, plan: SchedulePlan, free: int, budget: int) -> None: ...
        def _check_answer(
            self, plan: SchedulePlan, grow: GrowResult | None, admitted: list[AdmitResult]
        ) -> None: ...
        def _apply_grow(
            self, plan: SchedulePlan, grow: GrowResult, copies: list[tuple[int, int]]
        ) -> set[int]: ...
        def _apply_admissions(
            self, plan: SchedulePlan, admitted: list[AdmitResult]
        ) -> list[tuple[Sequence, int]]: ...
        def _take_granted(self, plan: SchedulePlan) -> list[tuple[Sequence, int]]: ...
        def _hold_back(
            self, chunks: list[ScheduledChunk], result: StepResult
        ) -> list[ScheduledChunk]: ...

    def plan_ahead(
        self, batch: ScheduledBatch, prompt_logprobs: bool = True
    ) -> SchedulePlan | None:
        """Phase one of the *next* step, made before this step's forward (async scheduling),
        so that its Step round trip overlaps the forward.

        The running sequences are planned as :meth:`plan` would plan them once ``batch`` has
        run and been sampled: a sequence that samples a token now grows by that token's slot,
        whatever the token turns out to be (one that finishes gives the slot back in the step
        after; one whose token is its last by ``max_tokens`` is left out), then prefill chunks
        go on within the token budget, then waiting sequences are admitted. None (nothing
        changed) when the next step must be planned after sampling: samples about to fork, a
        copy-on-write, too few free blocks without a preemption, or (``prompt_logprobs``: some
        request asks for them) a prompt whose every logits row is read. Admissions that only the
        blocks freed by this step's finished sequences would make fit wait one step."""
        if not batch.chunks or self._forks or self.swapped:
            return None  # (swapped-out sequences come back in a step planned after sampling)
        if prompt_logprobs and any(
            s.num_computed_tokens < s.prompt_len and s.wants_prompt_logprobs()
            for s in itertools.chain(self.running, self.waiting)
        ):
            return None  # a prompt whose every token's logits are read: planned after sampling
        scheduled = {c.seq.seq_id: c for c in batch.chunks}
        running = SeqStatus.RUNNING
        granted = [(s, k) for s, k in self.granted if s.status is running]
        held_back = {s.seq_id for s, _ in granted}  # they run next with the slots they hold
        decodes: list[tuple[Sequence, int]] = []  # (seq, slots it holds after this forward)
        prefills: list[tuple[Sequence, int, int]] = []  # (seq, slots, tokens left)
        for seq in self.running:
            if held_back and seq.seq_id in held_back:
                continue
            chunk = scheduled.get(seq.seq_id)
            slots = seq.num_computed_tokens
            if chunk is None:
                left = len(seq.token_ids) - slots
            elif chunk.need_logits:  # samples a token now
                slots += chunk.num_new_tokens
                num_output = slots + 1 - seq.prompt_len
                if num_output == 1 and seq.params.n > 1:
                    return None  # its other samples fork from this token
                if num_output >= seq.params.max_tokens:
                    continue  # this token is its last: nothing to grow
                left = 1
            else:
                slots += chunk.num_new_tokens
                left = len(seq.token_ids) - slots
            if left == 1:
                decodes.append((seq, slots))
            else:
                prefills.append((seq, slots, left))
        bs, refs = self.config.block_size, self.refs
        budget = self.config.max_num_batched_tokens - sum(k for _, k in granted)
        grows: list[tuple[Sequence, int]] = []
        grow_blocks: list[int] = []
        for seq, slots, left in itertools.chain(((s, n, 1) for s, n in decodes), prefills):
            if budget <= 0:
                break
            k = min(left, budget)
            tables = seq.tables
            if tables[0] and any(needs_cow(slots, k, bs, refs[t[-1]]) for t in tables):
                return None  # planned after sampling
            grows.append((seq, k))
            grow_blocks.append(blocks_to_grow(slots, k, len(tables[0]), bs) * len(tables))
            budget -= k
        need = sum(grow_blocks)
        if need > self.num_free_blocks or not (grows or granted or self.waiting):
            return None  # (this step's frees are not counted: conservative)
        plan, free = self._open_plan()
        plan.grows, plan.grow_blocks, plan.granted = grows, grow_blocks, granted
        if self.config.sliding_window:
            # What the grows will release, applied with the answer: this step's forward,
            # whose batch may not be built yet, still reads these tables.
            held = {seq.seq_id: slots for seq, slots in decodes}
            held.update((seq.seq_id, slots) for seq, slots, _ in prefills)
            plan.grow_first_live = [self._first_live_after(s, held[s.seq_id]) for s, _ in grows]
        self._plan_admissions(plan, free - need, budget)
        return plan

    def apply_ahead(self, plan: SchedulePlan, result: StepResult) -> ScheduledBatch:
        """Take the answer to a :meth:`plan_ahead` plan, after this step's forward and
        :meth:`after_forward` but before sampling: the next step's batch (the grown
        sequences' chunks, then the first chunks of the admitted ones). Until that batch
        runs, ``num_ahead_slots`` counts the slots granted ahead. A grow the pool refused
        preempts its sequence, as in :meth:`apply` (it is still sampled in this step: its
        token joins what it recomputes). An answer that contradicts the plan raises
        :class:`BadAnswer` with nothing applied but, in a sliding-window pool, the releases
        of the grows it granted (the pool's state either way; a resync restores ours)."""
        grow, admitted = plan.answers(result)
        if grow is not None and plan.grow_first_live:
            # The granted grows' releases, mirrored now that this step's forward has read its
            # tables, and before the check: the pool may already have handed those blocks out.
            for (seq, _), status, first in zip(
                plan.grows, grow.statuses, plan.grow_first_live, strict=True
            ):
                if status is OpStatus.OK:
                    self._release_to(seq, first)
        self._check_answer(plan, grow, admitted)  # no copy-on-write either: one is rejected
        failed = self._apply_grow(plan, grow, []) if grow is not None else set()
        chunks: list[ScheduledChunk] = []
        append, new = chunks.append, tuple.__new__  # hot: every sequence, every step
        for seq, k in plan.grows:
            if failed and seq.seq_id in failed:
                continue
            seq.num_ahead_slots = k
            # A sequence sampled in this step lacks its token yet: its chunk samples too.
            end = seq.num_computed_tokens + k
            append(new(ScheduledChunk, (seq, k, end >= len(seq.token_ids))))
        for seq, k in self._take_granted(plan):  # (their num_ahead_slots are k already)
            append(ScheduledChunk(seq, k, seq.num_computed_tokens + k == len(seq.token_ids)))
        for seq, k in self._apply_admissions(plan, admitted):
            seq.num_ahead_slots = k
            append(ScheduledChunk(seq, k, seq.num_computed_tokens + k == len(seq.token_ids)))
        self.num_free_blocks = result.counters.num_free_blocks
        return ScheduledBatch(self._hold_back(chunks, result), [], *step_moves(result))
