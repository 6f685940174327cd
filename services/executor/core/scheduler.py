"""The iteration-level scheduler (pure logic: no gRPC, no torch).

Every step the scheduler turns its queues into one ordered list of block-manager operations
(commit, free, fork, grow, admit), and after the block manager answered, into the chunks the
model computes. Order within a step: decode tokens of running sequences first (priority
order), then their prefill chunks (:mod:`.grows`: when one cannot grow, the newest is
preempted), then swap-ins (:mod:`.swapping`) or admissions of waiting ones
(:mod:`.admission`), all within ``max_num_batched_tokens`` and ``max_num_seqs``. A sequence
preempted by recompute gives up its blocks and waits, to be re-admitted with all its tokens.

:class:`Scheduler` owns its queues (waiting, running), the forks, frees and commits that go
out with the next Step, and the pool's free-block count. It holds the parts that own the
rest, each changed only through its methods:

- :class:`~.table_mirror.TableMirror`: the refcounts of the blocks its sequences hold, and
  every change to their tables. The scheduler is the only client of its pool, so the mirror
  is exact: it knows how many blocks a free releases and which grows need a copy-on-write,
  and preempts only when the pool's free blocks truly cannot cover the step;
- :class:`~.swapping.Swapping`: the swapped-out sequences and the host slots they hold;
- :class:`~.held_back.HeldBackChunks`: granted chunks that wait for a tier's fills;
- :class:`~.tier_failures.TierFailures`: the failed moves still to report.

The async path's planning (:mod:`.ahead`) owns no state.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

import structlog

from services.blockmgr.api.types import (
    AdmitResult,
    Commit,
    Fork,
    GrowResult,
    OpStatus,
    PoolCounters,
    RestoredSequence,
    StepResult,
)
from services.executor.core.admission import plan_admissions
from services.executor.core.ahead import ahead_chunks, next_grows
from services.executor.core.block_tokens import BlockTokens
from services.executor.core.config import SchedulerConfig
from services.executor.core.grows import plan_grows
from services.executor.core.held_back import HeldBackChunks
from services.executor.core.plan import (
    BadAnswer,
    ScheduledBatch,
    ScheduledChunk,
    SchedulePlan,
    granted_grows,
    step_batch,
)
from services.executor.core.sequence import FinishReason, SeqStatus, Sequence
from services.executor.core.swapping import Swapping, check_swaps
from services.executor.core.table_mirror import TableMirror, pool_view
from services.executor.core.tier_failures import TierFailures, readers

__all__ = [
    "BadAnswer",
    "SchedulePlan",
    "ScheduledBatch",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
]

log = structlog.get_logger(__name__)


class Scheduler:
    """Plans each step (:meth:`plan`, or :meth:`plan_ahead` before the forward), takes the
    block manager's answer (:meth:`apply`, :meth:`apply_ahead`; :meth:`abandon`), and
    advances after the forward (:meth:`after_forward`). Single-threaded, like the engine."""

    def __init__(self, config: SchedulerConfig, counters: PoolCounters) -> None:
        self.config = config
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_free_blocks = counters.num_free_blocks
        self.num_usable_blocks = counters.num_usable_blocks
        self.mirror = TableMirror(config)
        self.swapping = Swapping(config)
        self.held_back = HeldBackChunks(config.defer_filled_chunks)
        self.tier_failures = TierFailures()
        self._to_free: list[RestoredSequence] = []  # the pool's view of seqs to free next Step
        self._forks: dict[int, Fork] = {}  # child seq_id -> pending Fork, sent next Step
        self._commits: list[Commit] = []
        self.block_tokens = BlockTokens(2 * counters.num_usable_blocks + 64)  # (KV events)
        self.num_preemptions = 0

    # ---- queue management -----------------------------------------------------------------

    @property
    def swapped(self) -> list[Sequence]:
        """The swapped-out sequences, in priority order (read only)."""
        return self.swapping.swapped

    @property
    def num_chunks_held_back(self) -> int:
        return self.held_back.num_held_back

    @property
    def has_work(self) -> bool:
        pending = self._to_free or self._commits or self.tier_failures.pending
        return bool(self.waiting or self.running or self.swapping.swapped or pending)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence for admission."""
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=_sort_key)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (a sample of an n > 1 request, its first token drawn from ``parent``'s
        logits; or a beam continuing ``parent`` with another token) shares all of
        ``parent``'s blocks from now on; the Fork is sent first thing in
        the next step. When ``max_num_seqs`` sequences already run, it waits instead and is
        admitted later like a preempted sequence (its prompt blocks are prefix hits then)."""
        child.num_cached_tokens = parent.num_cached_tokens
        child.admitted_once = True
        if len(self.running) >= self.config.max_num_seqs or parent.status is not SeqStatus.RUNNING:
            self.add(child)  # (a beam's parent may have been preempted: nothing to share)
            return
        self.mirror.share(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        bs = self.config.block_size
        shared = (len(child.token_ids) - 1) // bs  # full blocks of the tokens they share
        child.num_committed_blocks = min(parent.num_committed_blocks, shared)
        child.block_hashes = parent.block_hashes[:shared]
        child.status = SeqStatus.RUNNING
        bisect.insort(self.running, child, key=_sort_key)
        self._forks[child.seq_id] = Fork(parent.seq_id, child.seq_id)

    def finish(self, seq: Sequence, reason: FinishReason, stop_token: int | None = None) -> None:
        """Retire a sequence (idempotent). Its blocks are freed by the next step's Step."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.SWAPPED:  # its slots are freed with the next Step
            self._to_free.append(pool_view(seq))
            self.swapping.remove(seq)
        else:
            self.running.remove(seq)
            self._drop_blocks(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_token = stop_token

    # ---- phase one: plan ------------------------------------------------------------------

    def plan(self) -> SchedulePlan:
        """Phase one of a step: the operations to send (pending commits, forks and frees,
        the grows of :func:`~.grows.plan_grows`, then swap-ins or admissions)."""
        plan, free = self._open_plan()
        scheduled: set[int] = set()  # (held-back chunks first: their slots are held)
        budget = self.config.max_num_batched_tokens - self.held_back.plan(plan, scheduled)
        free, budget, preempted = plan_grows(
            plan,
            self.running,
            self.mirror,
            self.config,
            free=free,
            budget=budget,
            scheduled=scheduled,
            preempt=self._preempt_for_room,
        )
        # Children preempted while planning cancelled their own forks.
        plan.forks = list(self._forks.values())
        plan.fork_ids = set(self._forks)
        self._forks = {}
        # No admissions in a step that had to preempt: the pool is under pressure. Swapped-out
        # sequences come back before anything new is admitted.
        if not preempted:
            if self.swapping.swapped:
                stuck = self.swapping.plan_swap_ins(plan, free, self.running)
                if stuck is not None:
                    self._recompute_swapped(stuck, plan)
            else:
                plan_admissions(plan, self.waiting, self.running, self.config, free, budget)
        return plan

    def _open_plan(self) -> tuple[SchedulePlan, int]:
        """A new plan carrying the pending commits and frees, and the free blocks after them."""
        plan = SchedulePlan(
            uncache=self.tier_failures.take(),
            commits=self._commits,
            released=self._to_free,
            speculative=self.config.speculative,
        )
        free = self.num_free_blocks
        for view in self._to_free:
            free += self.mirror.release(view.block_ids)
            plan.free_seq_ids.append(view.seq_id)
        self._to_free, self._commits = [], []
        return plan, free

    # ---- phase two: apply the block manager's answer ---------------------------------------

    def apply(self, plan: SchedulePlan, result: StepResult) -> ScheduledBatch:
        """Take the block manager's answer to ``plan``: new blocks, copies, admissions.

        The answer is checked against what the plan asked for before anything changes; one
        that contradicts it raises :class:`BadAnswer` and changes nothing (see
        :meth:`abandon`)."""
        grow, admitted = plan.answers(result)
        self.mirror.check_answer(plan, grow, admitted, num_blocks=self.num_usable_blocks + 1)
        if plan.swap_outs or plan.swap_ins:
            check_swaps(
                plan,
                result,
                swap_slots=self.config.swap_slots,
                num_blocks=self.num_usable_blocks + 1,
            )
            for seq, block_ids in self.swapping.apply(plan, result):  # back in
                self.mirror.swap_in(seq, block_ids)
                seq.status = SeqStatus.RUNNING
                bisect.insort(self.running, seq, key=_sort_key)
        copies: list[tuple[int, int]] = []
        grows = plan.grows
        if grow is not None:
            failed, copies = self._apply_grow(plan, grow)
            if failed:
                grows = [(s, k) for s, k in grows if s.seq_id not in failed]
            if plan.speculative:
                granted_grows(grows)
        new_prefills = self._apply_admissions(plan, admitted)
        self.num_free_blocks = result.counters.num_free_blocks
        chunks = [
            ScheduledChunk(
                s, k, s.num_computed_tokens + k - s.num_scheduled_drafts == len(s.token_ids)
            )
            for s, k in itertools.chain(grows, self.held_back.take(plan), new_prefills)
        ]
        return step_batch(self.held_back.hold_back(chunks, result), copies, result, self.config)

    def _apply_admissions(
        self, plan: SchedulePlan, admitted: list[AdmitResult]
    ) -> list[tuple[Sequence, int]]:
        """Run the admitted sequences (the others stay waiting, in their place); returns each
        with the tokens of its first chunk."""
        new_prefills: list[tuple[Sequence, int]] = []
        for (seq, _), res in zip(plan.admits, admitted, strict=True):
            if res.status is not OpStatus.OK:
                continue
            self.waiting.remove(seq)
            self.mirror.admit(seq, res.block_ids, res.num_cached_tokens)
            seq.num_computed_tokens = res.num_cached_tokens
            seq.num_committed_blocks = self.block_tokens.hit(seq, self.config.block_size, res)
            if not seq.admitted_once:  # (a resumed sample's output may hit too: not counted)
                seq.num_cached_tokens = min(res.num_cached_tokens, seq.prompt_len)
                seq.admitted_once = True
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=_sort_key)
            new_prefills.append((seq, res.num_tokens - res.num_cached_tokens))
        return new_prefills

    def _apply_grow(
        self, plan: SchedulePlan, grow: GrowResult
    ) -> tuple[set[int], list[tuple[int, int]]]:
        """Take the (checked) grow answer into the tables; a sequence whose grow the pool
        refused is requeued. Returns the ids of those and the block copies to make."""
        failed, copies = self.mirror.apply_grow(plan, grow)
        if failed:
            for seq, _ in plan.grows:
                if seq.seq_id in failed:
                    self._requeue_refused(seq)
        return failed, copies

    def abandon(self, plan: SchedulePlan) -> None:
        """Forget the answer to ``plan`` (it contradicted the plan): grows and admissions did
        not happen. The refcount mirror takes back the shares copy-on-write grows gave up;
        frees, preemptions, forks and commits of the plan stand. The pool must then be rebuilt
        from this state (a resync) before the next Step."""
        for seq, _ in plan.grows:
            if seq.tables[0]:
                self.mirror.take_back_shares(seq, plan.cow_ids.get(seq.seq_id, ()))
        if plan.swap_outs:
            for seq in self.swapping.unswap(plan):  # recomputed instead
                self._back_to_waiting(seq)

    # ---- async scheduling (ahead.py) -------------------------------------------------------

    def plan_ahead(
        self, batch: ScheduledBatch, prompt_logprobs: bool = True
    ) -> SchedulePlan | None:
        """Phase one of the *next* step, made before this step's forward (async scheduling),
        so that its Step round trip overlaps the forward: the running sequences' grows as
        :meth:`plan` would plan them once ``batch`` has run and been sampled
        (:func:`~.ahead.next_grows`; one that finishes gives its slot back in the step after),
        then admissions, in seats that this step's last tokens free too. None (nothing
        changed) when the next step must be planned after sampling: samples about to fork, a
        copy-on-write, too few free blocks without a preemption, or (``prompt_logprobs``:
        some request asks for them) a prompt whose every logits row is read. Admissions that
        only the blocks freed by this step's finished sequences would make fit wait one step."""
        if not batch.chunks or self._forks or self.swapping.swapped:
            return None  # (swapped-out sequences come back in a step planned after sampling)
        if prompt_logprobs and any(
            s.num_computed_tokens < s.prompt_len and s.wants_prompt_logprobs()
            for s in itertools.chain(self.running, self.waiting)
        ):
            return None  # a prompt whose every token's logits are read: planned after sampling
        cfg, granted = self.config, self.held_back.running()
        ahead = next_grows(batch, self.running, granted, self.mirror.refs, cfg)
        if ahead is None:
            return None
        need = sum(ahead.grow_blocks)
        if need > self.num_free_blocks or not (ahead.grows or granted or self.waiting):
            return None  # (this step's frees are not counted: conservative)
        plan, free = self._open_plan()
        plan.grows, plan.grow_blocks, plan.granted = ahead.grows, ahead.grow_blocks, granted
        plan.ahead_counts = ahead.counts  # (speculating: what each grow reports and holds)
        if cfg.sliding_window:
            # What the grows will release, applied with the answer: this step's forward,
            # whose batch may not be built yet, still reads these tables.
            first_live_after = self.mirror.first_live_after
            plan.grow_first_live = [
                first_live_after(s, held)
                for (s, _), held in zip(ahead.grows, ahead.held, strict=True)
            ]
        room = (free - need, ahead.budget, ahead.num_finishing)
        plan_admissions(plan, self.waiting, self.running, cfg, *room)
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
                    self.mirror.release_to(seq, first)
        # (no copy-on-write either: one is rejected)
        self.mirror.check_answer(plan, grow, admitted, num_blocks=self.num_usable_blocks + 1)
        failed = self._apply_grow(plan, grow)[0] if grow is not None else set()
        granted, admitted_chunks = self.held_back.take(plan), self._apply_admissions(plan, admitted)
        chunks = ahead_chunks(plan, failed, granted, admitted_chunks)
        self.num_free_blocks = result.counters.num_free_blocks
        return step_batch(self.held_back.hold_back(chunks, result), [], result, self.config)

    # ---- after the forward ----------------------------------------------------------------

    def after_forward(self, chunks: Iterable[ScheduledChunk]) -> int:
        """Advance computed counts and queue commits of newly full blocks for the next step.
        Returns the number of prompt tokens the chunks computed (recomputation included)."""
        bs, caching = self.config.block_size, self.config.enable_prefix_caching
        num_prompt_tokens = 0
        for seq, k, _ in chunks:
            start = seq.num_computed_tokens
            if start < seq.prompt_len:
                num_prompt_tokens += min(start + k, seq.prompt_len) - start
            # (its drafts, if any, count once verified: accept_drafts)
            seq.num_computed_tokens = start + k - seq.num_scheduled_drafts
            seq.num_ahead_slots = 0
            full = seq.num_pool_tokens // bs  # (accepted drafts it has not reported wait)
            if caching and full > seq.num_committed_blocks:
                self._commits.append(self.block_tokens.commit(seq, bs, full))
                seq.num_committed_blocks = full
        return num_prompt_tokens

    # ---- recovery -------------------------------------------------------------------------

    def pre_plan_state(self, plan: SchedulePlan | None) -> list[RestoredSequence]:
        """The pool's sequences as they were before ``plan``'s operations (as they are now,
        without a plan): a restarted block manager restored to this state can take the same
        operations again."""
        if plan is None:
            forked: set[int] = set(self._forks)
            released = list(self._to_free)
        else:
            forked, released = plan.fork_ids, plan.released
        live = [pool_view(s) for s in self.running if s.tables[0] and s.seq_id not in forked]
        if self.swapping.swapped:
            live += self.swapping.views()
        return live + released

    # ---- internals ------------------------------------------------------------------------

    def _drop_blocks(self, seq: Sequence) -> int:
        """Give up ``seq``'s blocks. A fork not yet sent is cancelled: nothing to free in the
        pool, and the blocks that only it held in our mirror are free now (returned). Otherwise
        the Free goes out with the next Step."""
        if self._forks.pop(seq.seq_id, None) is not None:
            return self.mirror.drop(seq)
        if seq.tables[0]:
            self._to_free.append(pool_view(seq))
        self.mirror.detach(seq)
        return 0

    def _preempt_for_room(self, seq: Sequence, plan: SchedulePlan) -> int:
        """Preempt a running sequence while planning: its Free joins this step's operations.
        Returns how many blocks this frees now."""
        if seq.seq_id not in self._forks and self.swapping.can_take(seq):
            return self._swap_out(seq, plan)
        if seq.tables[0] and seq.seq_id not in self._forks:
            plan.free_seq_ids.append(seq.seq_id)
            plan.released.append(pool_view(seq))
            freed = self.mirror.drop(seq)
        else:  # a pending fork is cancelled
            freed = self._drop_blocks(seq)
        self._requeue(seq)
        return freed

    def _swap_out(self, seq: Sequence, plan: SchedulePlan) -> int:
        """Preempt running ``seq`` by swapping it out with ``plan``'s Step; returns how many
        blocks this frees now."""
        self.swapping.swap_out(seq, plan)
        freed = self.mirror.drop(seq)
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        return freed

    def _recompute_swapped(self, seq: Sequence, plan: SchedulePlan) -> None:
        """``seq`` cannot come back (its blocks do not fit the pool even alone): it is freed
        with ``plan``'s Step and recomputed instead, never left waiting forever."""
        log.warning("swapped_sequence_recomputed", seq_id=seq.seq_id, req_id=seq.req_id)
        plan.free_seq_ids.append(seq.seq_id)
        plan.released.append(pool_view(seq))
        self.swapping.remove(seq)
        self._back_to_waiting(seq)

    def moves_failed(
        self, device_blocks: Iterable[int], disk_slots: Iterable[int]
    ) -> list[Sequence]:
        """Report these failed moves with the next Step (see :mod:`.tier_failures`), and
        preempt (to recompute) the running sequences whose tables list one of
        ``device_blocks``; returns them."""
        blocks, slots = tuple(device_blocks), tuple(disk_slots)
        self.tier_failures.add(blocks, slots)
        victims = readers(self.running, blocks)
        for seq in victims:
            self.preempt(seq)
        log.warning(
            "kv_tier_moves_failed",
            device_blocks=len(blocks),
            disk_slots=len(slots),
            recomputed=[s.seq_id for s in victims],
        )
        return victims

    def preempt(self, seq: Sequence) -> None:
        """Preempt a running sequence between steps (recomputed when admitted again); its
        Free goes out with the next Step."""
        if seq.status is SeqStatus.RUNNING:
            self._requeue_refused(seq)

    def _requeue_refused(self, seq: Sequence) -> None:
        """Preempt a sequence whose grow the pool refused after the fact: its Free goes out
        with the next Step."""
        self._drop_blocks(seq)
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Move a running sequence that gave up its blocks back to waiting (recompute)."""
        self.running.remove(seq)
        seq.num_ahead_slots = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._back_to_waiting(seq)
        log.warning(
            "sequence_preempted",
            req_id=seq.req_id,
            seq_id=seq.seq_id,
            num_tokens=seq.num_tokens,
            num_preemptions=seq.num_preemptions,
        )

    def _back_to_waiting(self, seq: Sequence) -> None:
        """Queue ``seq``, which holds no blocks now, to be admitted again and recomputed."""
        seq.num_computed_tokens = seq.num_committed_blocks = seq.first_live_block = 0
        seq.forget_speculation()
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=_sort_key)


def _sort_key(seq: Sequence) -> tuple[int, int, int]:
    return seq.sort_key
